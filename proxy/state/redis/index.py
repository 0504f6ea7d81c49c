"""The Redis prefix index: one mirror shared by every prefixgate replica.

Layout, namespaced per model (agreed by the replicas: ``index_namespace.py``, ``move_to``), block
size and block hash algorithm (``{prefix}:{model}:{block_size}:{hash_algo}:``: no shared keys between
replicas hashing differently):
- ``lru:{rank}``: a sorted set per rank; member = a block's 8-byte key (``_keys_blob``), score = its
  last use in microseconds (a shared monotonic tick, so a request's blocks get distinct scores, head
  highest: past capacity ``ZPOPMIN`` drops the tail of the least recent chain first, and entries older
  than the TTL are dropped and never matched);
- ``cpu:{rank}``: a set per rank of the keys of its blocks held in CPU memory only (vLLM's KV
  offloading; written from KV events, by the rank's event writer below), so that a lookup tells every
  replica, by tier, what the rank holds: ``Lookup.offloaded``;
- ``tick``: that clock; ``sess:{key}``: a session's rank, with the same TTL, bound first writer wins
  (``index_scripts.BIND``: two replicas placing one new session at once agree on the first's).

A lookup is ONE round trip: a Lua script finds, per rank, the longest held (and unexpired) prefix by
galloping then bisecting over block positions (about 2 log2(n) ``ZSCORE`` probes instead of n), then
how many of those it holds in CPU memory only (bisecting again: they are the match's last), and
reads the session's rank. Bisection assumes each rank's blocks form prefixes, which the mirror keeps:
blocks are evicted tail first and corrections trim a chain's suffix; a hole in the middle of a chain
(rare) can make the match overstate that chain.

A record is one round trip too, off the request's path, and costs O(new blocks): a returning session's
chain, whose leading blocks this replica wrote before, gets only its new tail written, scored just below
its last held block (``index_scripts.EXTEND``); the whole chain is rewritten when Redis lost that block
or the chain sank past a quarter of the rank's capacity or of the TTL, so the LRU order stays within a
quarter of the pool's turnover of the truth.

An event-fed rank (``--kv-events``: every replica subscribes to every rank and keeps its own exact mirror)
is written to Redis by ONE replica, the holder of the rank's lease (``events:{rank}``, ``EVENTS_LEASE_S``,
renewed by its writes, ``index_scripts.LEASE``): the other replicas apply the same events to their local
mirrors only, so each event costs Redis one write, not one per replica (and a run of evictions, one
event per block from vLLM, one write: ``RankMirror.apply``).
The shared copy is what a replica that started after the rank (its subscription cannot map chains begun
before it) or whose subscription failed learns from. A replica taking a lapsed lease over pushes its
mirror of the rank first (it wrote nothing meanwhile). The writer pushes its mirror again every quarter
of the TTL while events flow: a block the rank keeps serving from its cache gets no new event, and must
not expire from the shared copy (a chain whose first block expired matches nothing) while it is held.

Redis is never on a request's critical path for correctness: every update is also applied to a local
``MemoryPrefixIndex``; when Redis fails, the store answers from that mirror, reports itself down, and its
``RedisLink`` (``link.py``: one circuit breaker for every store on that Redis) probes
it every ``retry_interval`` s off the event loop; once Redis answers, the local mirror is pushed back
(Redis may have restarted empty) before serving from Redis again.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence

from proxy.state.redis.index_scripts import BIND, EXTEND, LEASE, MATCH, RECORD, REMOVE, TIERS
from proxy.state.redis.link import DEFAULT_RETRY_INTERVAL_S, ERRORS, RedisLink, fail_fast_client
from proxy.state.redis.topology import reply_text, slot_prefix
from routing.index import GPU, Lookup
from routing.index.memory import MemoryPrefixIndex

log = logging.getLogger("prefixgate.index.redis")

DEFAULT_TTL_S = 3600.0
#: Short: a hung Redis must not stall the event loop, which calls the index synchronously.
DEFAULT_SOCKET_TIMEOUT_S = 0.25
#: How long an event-fed rank's writer keeps its lease without writing: how long the shared copy can
#: miss events when its writer dies (every replica's own mirror misses none).
EVENTS_LEASE_S = 10.0


def _keys_blob(block_hashes: Sequence[bytes]) -> bytes:
    # A block's key is its digest's last 8 bytes, as vLLM's KV events do: a 64-bit collision between
    # two prefixes is negligible at fleet scale, and a 100k-token lookup sends 50 kB instead of 200 kB.
    if not block_hashes:
        return b""
    joined = b"".join(block_hashes)
    width = len(block_hashes[0])
    if width % 8 == 0 and len(joined) == width * len(block_hashes):
        # One hasher makes a chain, so its digests share one width (8, 16 or 32 bytes): every
        # digest's last 8 bytes are every (width/8)-th 8-byte word of the joined chain, taken in C.
        # Slicing each digest in Python was ~16 % of a process's CPU on 100k-token turns.
        words = width // 8
        return memoryview(joined).cast("Q")[words - 1 :: words].tobytes()
    return b"".join([h[-8:] for h in block_hashes])


class RedisPrefixIndex:
    """``PrefixIndex`` over Redis, with a local mirror that takes over while Redis is unreachable."""

    def __init__(
        self,
        url: str,
        *,
        model: str = "default",
        block_size: int = 16,
        hash_algo: str = "sha256",
        ttl_s: float = DEFAULT_TTL_S,
        prefix: str = "prefixgate",
        socket_timeout: float = DEFAULT_SOCKET_TIMEOUT_S,
        retry_interval: float = DEFAULT_RETRY_INTERVAL_S,
        on_state: Callable[[bool], None] | None = None,
        local: MemoryPrefixIndex | None = None,
        link: RedisLink | None = None,
        events_lease_s: float = EVENTS_LEASE_S,
    ) -> None:
        """``link``: the Redis link shared with the other stores on this Redis (None: one over ``url``)."""
        self.url = url
        self._owns_link = link is None
        self.link = link or RedisLink(fail_fast_client(url, socket_timeout), retry_interval, "redis index")
        self._layout = f"{prefix}:{{model}}:{block_size}:{hash_algo}"
        self.namespace = self._namespace(model)
        self.ttl_s = ttl_s
        self.local = local if local is not None else MemoryPrefixIndex()
        self._client = self.link.client
        self._match = self._client.register_script(MATCH)
        self._record = self._client.register_script(RECORD)
        self._remove = self._client.register_script(REMOVE)
        self._extend = self._client.register_script(EXTEND)
        self._bind = self._client.register_script(BIND)
        self._lease = self._client.register_script(LEASE)
        self._tiers = self._client.register_script(TIERS)
        self.replica_id = uuid.uuid4().hex
        self.events_lease_s = events_lease_s
        #: Event-fed ranks whose lease this replica held at its last renewal (the link's thread's).
        self._event_writer: set[str] = set()
        #: When each event-fed rank's lease is due for renewal (monotonic; the event thread's).
        self._lease_due: dict[str, float] = {}
        #: When the writer pushes each event-fed rank's mirror again (monotonic; the link thread's).
        self._refresh_due: dict[str, float] = {}
        self.event_writes = 0
        #: Chains written whole, and chains of which only the new tail was written (on a
        #: returning session's turn): what keeps Redis's work per request O(new blocks).
        self.full_writes = 0
        self.tail_writes = 0
        self._capacity: dict[str, int | None] = {}
        self._ranks: list[str] = []
        self._lru_keys: list[str] = []
        self._cpu_keys: list[str] = []
        if on_state is not None:
            self.link.on_state(on_state)
        self.link.on_resync(self.resync)

    @property
    def up(self) -> bool:
        return self.link.up

    @property
    def failures(self) -> int:
        return self.link.failures

    @property
    def resyncs(self) -> int:
        return self.link.resyncs

    # -- background writes ------------------------------------------------------------------------
    # Writes (record, remove, session) go to Redis from the link's thread, in order, so a request
    # never waits for them: recording a 100k-token prompt costs ~10 ms of Redis time. The local
    # mirror is updated at once, and lookups merge it in, so this replica's own fresh records are
    # seen immediately; other replicas see them once written.

    def _submit(self, write: Callable[[], object]) -> None:
        self.link.submit(write)

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until every submitted write reached Redis (or was dropped because it is down)."""
        self.link.flush(timeout)

    def _namespace(self, model: str) -> str:
        # a hash tag on a cluster: a lookup's script reads every rank's set and the session's key
        return slot_prefix(self._layout.format(model=model), self.link.client) + ":"

    def move_to(self, model: str) -> None:
        """Use ``model``'s namespace from now on (agreed once a first rank is up), the mirror pushed there."""
        self.namespace = self._namespace(model)
        self._lru_keys = [self._lru_key(rank) for rank in self._ranks]
        self._cpu_keys = [self._cpu_key(rank) for rank in self._ranks]
        self._submit(self.resync)

    def _lru_key(self, rank: str) -> str:
        return f"{self.namespace}lru:{rank}"

    def _cpu_key(self, rank: str) -> str:
        return f"{self.namespace}cpu:{rank}"

    def _session_key(self, session_key: str) -> str:
        return f"{self.namespace}sess:{session_key}"

    def _record_call(self, rank: str, block_hashes: Sequence[bytes]) -> tuple[list[str], list[bytes | int]]:
        """Keys and arguments of the record script: ``block_hashes`` (newest first) on ``rank``."""
        cap = self._capacity.get(rank)
        keys = [self._lru_key(rank), self.namespace + "tick"]
        return keys, [_keys_blob(block_hashes), -1 if cap is None else cap, int(self.ttl_s * 1e6)]

    def _session_ttl(self) -> int:
        """A session binding's expiry in whole seconds: Redis refuses EX 0, so never under 1."""
        return max(1, int(self.ttl_s))

    def _available(self) -> bool:
        return self.link.available()

    def resync(self) -> None:
        """Push the local mirror (blocks in LRU order, sessions) to Redis. Raises on Redis errors.
        Runs on the link's thread (or a caller's without an event loop) while the loop may update
        the mirror: it reads snapshots (``blocks``, ``sessions`` copy under the GIL)."""
        for rank in list(self._ranks):
            blocks = self.local.blocks(rank)  # least recent first: head of the list = newest
            blocks.reverse()
            keys, args = self._record_call(rank, blocks)
            self._record(keys=keys, args=args)
            self._write_tiers(rank, self.local.offloaded_blocks(rank), (), whole=True)
        sessions = self.local.sessions()
        if sessions:
            pipe = self._client.pipeline(transaction=False)
            for key, rank in sessions:
                pipe.set(self._session_key(key), rank, ex=self._session_ttl())
            pipe.execute()

    # -- PrefixIndex -----------------------------------------------------------------------------

    def set_capacity(self, rank: str, blocks: int | None) -> None:
        if rank not in self._capacity:
            self._ranks.append(rank)
            self._lru_keys.append(self._lru_key(rank))
            self._cpu_keys.append(self._cpu_key(rank))
        self._capacity[rank] = blocks
        self.local.set_capacity(rank, blocks)

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        return self.lookup(block_hashes, None).matches

    def lookup(self, block_hashes: Sequence[bytes], session_key: str | None) -> Lookup:
        local = self.local.lookup(block_hashes, session_key)
        if not self._available() or not self._ranks or (not block_hashes and not session_key):
            return local
        keys = [*self._lru_keys, *self._cpu_keys]
        if session_key:
            keys.append(self._session_key(session_key))
        try:
            out = self._match(
                keys=keys, args=[_keys_blob(block_hashes), int(self.ttl_s * 1e6), len(self._ranks)]
            )
        except ERRORS as exc:
            self.link.failed(exc)
            return local
        nb = len(self._ranks)
        matches = {b: int(n) for b, n in zip(self._ranks, out, strict=False) if n}
        offloaded = {b: int(n) for b, n in zip(self._ranks, out[nb + 1 :], strict=False) if n}
        for rank, blocks in local.matches.items():  # this replica's writes not yet in Redis
            if blocks > matches.get(rank, 0):
                matches[rank] = blocks
                offloaded.pop(rank, None)
                if local.offloaded.get(rank):
                    offloaded[rank] = local.offloaded[rank]
        session = out[nb] if session_key and out[nb] else None
        session_rank = reply_text(session) if session else None
        return Lookup(matches, session_rank or local.session_rank, offloaded)

    def record(
        self, rank: str, block_hashes: Sequence[bytes], *, counted: bool = False, medium: str = GPU
    ) -> None:
        if counted:
            # Counts live locally; Redis learns the hashes that were not held yet, and which blocks
            # moved between tiers (a reload puts CPU-only blocks back on the GPU).
            fresh = self.local.missing(rank, block_hashes)
            before = self.local.offloaded_among(rank, block_hashes)
            self.local.record(rank, block_hashes, counted=True, medium=medium)
            if fresh:
                chain = fresh if len(fresh) != len(block_hashes) else block_hashes
                self._event_write(rank, lambda: self._write_whole(rank, chain))
            self._retier(rank, block_hashes, before)
            return
        # what this replica wrote to Redis already: a chain is recorded from block 0 and evicted
        # tail first, so it is the mirror's held prefix (Redis checks its last block)
        held = self.local.held_prefix(rank, block_hashes)
        self.local.record(rank, block_hashes)
        if not block_hashes:
            return
        if rank not in self._capacity:
            self.set_capacity(rank, None)
        if held:
            self._submit(lambda: self._write_tail(rank, block_hashes, held))
            return
        self._submit(lambda: self._write_whole(rank, block_hashes))

    def _write_tail(self, rank: str, chain: Sequence[bytes], held: int) -> None:
        """On the link's thread: write ``chain``'s blocks past ``held`` below its last held block, or
        the whole chain when Redis lost that block or its place in the LRU order is too old."""
        cap = self._capacity.get(rank)
        args: list[bytes | int] = [
            _keys_blob(chain[held:]),
            chain[held - 1][-8:],
            held,
            -1 if cap is None else cap,
            int(self.ttl_s * 1e6),
        ]
        if int(self._extend(keys=[self._lru_key(rank)], args=args)) >= 0:
            self.tail_writes += 1
        else:
            self._write_whole(rank, chain)

    def _write_whole(self, rank: str, chain: Sequence[bytes]) -> None:
        keys, args = self._record_call(rank, chain)
        self._record(keys=keys, args=args)
        self.full_writes += 1

    def remove(
        self, rank: str, block_hashes: Sequence[bytes], *, counted: bool = False, medium: str = GPU
    ) -> None:
        before = self.local.offloaded_among(rank, block_hashes) if counted else set()
        self.local.remove(rank, block_hashes, counted=counted, medium=medium)
        if counted:
            self._retier(rank, block_hashes, before)
            block_hashes = self.local.missing(rank, block_hashes)
        if not block_hashes:
            return
        keys, args = [self._lru_key(rank)], [_keys_blob(block_hashes)]
        if counted:
            self._event_write(rank, lambda: self._remove(keys=keys, args=args))
        else:
            self._submit(lambda: self._remove(keys=keys, args=args))

    def _retier(self, rank: str, block_hashes: Sequence[bytes], before: set[bytes]) -> None:
        """After a KV event changed ``block_hashes`` on ``rank``: tell Redis which of them are held in
        CPU memory only now, and which no longer (``before``: those that were)."""
        after = self.local.offloaded_among(rank, block_hashes)
        if after == before:
            return
        added, gone = [h for h in after if h not in before], [h for h in before if h not in after]
        self._event_write(rank, lambda: self._write_tiers(rank, added, gone))

    def _write_tiers(
        self, rank: str, added: Sequence[bytes], removed: Sequence[bytes], *, whole: bool = False
    ) -> None:
        """On the link's thread: ``rank``'s CPU-only set gains ``added`` and loses ``removed``
        (``whole``: ``added`` is the whole set)."""
        if not added and not removed and not whole:
            return
        args = [_keys_blob(added), _keys_blob(removed), "1" if whole else "0", int(self.ttl_s * 1000)]
        self._tiers(keys=[self._cpu_key(rank)], args=args)

    # -- event-fed ranks: one writer per rank -----------------------------------------------------

    def _event_write(self, rank: str, write: Callable[[], object]) -> None:
        """``write`` (a KV event's change to ``rank``) reaches Redis if this replica holds the rank's
        lease when the link's thread gets to it; the lease is renewed first when due."""
        if rank not in self._capacity:
            self.set_capacity(rank, None)
        now = time.monotonic()
        if now >= self._lease_due.get(rank, 0.0):
            self._lease_due[rank] = now + self.events_lease_s / 3
            self._submit(lambda: self._renew_lease(rank))

        def if_writer() -> None:
            if rank in self._event_writer:
                write()
                self.event_writes += 1

        self._submit(if_writer)

    def _renew_lease(self, rank: str) -> None:
        """On the link's thread: take or renew ``rank``'s lease; on a takeover, push the mirror."""
        lease = f"{self.namespace}events:{rank}"
        won = int(
            self._lease(
                keys=[lease, lease + ":last"], args=[self.replica_id, int(self.events_lease_s * 1000)]
            )
        )
        if not won:
            if rank in self._event_writer:
                log.info("rank %s: another replica writes its KV events to Redis now", rank)
            self._event_writer.discard(rank)
            return
        now = time.monotonic()
        if won == 2 or now >= self._refresh_due.setdefault(rank, now + self.ttl_s / 4):
            self._refresh_due[rank] = now + self.ttl_s / 4
            blocks = self.local.blocks(rank)  # least recent first
            blocks.reverse()
            if blocks:
                self._write_whole(rank, blocks)
            self._write_tiers(rank, self.local.offloaded_blocks(rank), (), whole=True)
            if won == 2:
                log.info(
                    "rank %s: this replica writes its KV events to Redis (%d blocks pushed)",
                    rank,
                    len(blocks),
                )
        self._event_writer.add(rank)

    def clear(self, rank: str, medium: str | None = None) -> None:
        if medium is not None:  # one tier emptied: Redis drops the blocks no tier holds any more
            held = self.local.blocks(rank)
            before = set(self.local.offloaded_blocks(rank))
            self.local.clear(rank, medium)
            gone = self.local.missing(rank, held)
            if gone:
                keys, args = [self._lru_key(rank)], [_keys_blob(gone)]
                self._event_write(rank, lambda: self._remove(keys=keys, args=args))
            self._retier(rank, held, before)
            return
        self.local.clear(rank)
        key = self._lru_key(rank)
        self._submit(lambda: self._client.delete(self._cpu_key(rank)))
        # Now, so that every replica stops matching the rank's old blocks at once; and again behind
        # this replica's writes still queued, which would otherwise bring them back when they land.
        self._submit(lambda: self._client.delete(key))
        if not self._available():
            return
        try:
            self._client.delete(key)
        except ERRORS as exc:
            self.link.failed(exc)

    def held_by_tier(self, rank: str) -> tuple[int, int]:
        # this replica's mirror (exact for the ranks whose events it reads): a read, no round trip
        return self.local.held_by_tier(rank)

    def set_session_rank(self, session_key: str, rank: str) -> None:
        self.local.set_session_rank(session_key, rank)
        key, ttl = self._session_key(session_key), self._session_ttl()
        self._submit(lambda: self._client.set(key, rank, ex=ttl))

    def bind_session(self, session_key: str, rank: str, previous: str | None) -> str:
        # On the request's path (one round trip, for a new or moving session only): the router must
        # know the winner before it forwards. Redis down: this replica's own view decides.
        bound = rank
        if self._available():
            key, ttl = self._session_key(session_key), self._session_ttl()
            try:
                won = self._bind(keys=[key], args=[rank, previous or "", ttl])
            except ERRORS as exc:
                self.link.failed(exc)
            else:
                bound = reply_text(won)
        self.local.set_session_rank(session_key, bound)
        return bound

    def forget_session(self, session_key: str) -> None:
        self.local.forget_session(session_key)
        key = self._session_key(session_key)
        self._submit(lambda: self._client.delete(key))

    def event_writer_of(self) -> frozenset[str] | None:
        return frozenset(self._event_writer)  # a copy: the link's thread changes the set

    def stats(self) -> dict[str, object]:
        local = self.local.stats()
        return {
            **local,
            "store": "redis",
            "redis_up": self.up,
            "redis_failures": self.failures,
            "redis_resyncs": self.resyncs,
            "redis_full_writes": self.full_writes,
            "redis_tail_writes": self.tail_writes,
            "redis_event_writes": self.event_writes,
            "redis_event_writer_of": sorted(self._event_writer),
        }

    def close(self) -> None:
        self.link.flush()
        if self._owns_link:
            self.link.close()
