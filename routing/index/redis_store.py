"""The Redis prefix index: one mirror shared by every prefixgate replica.

Layout, namespaced per model, block size and block hash algorithm
(``{prefix}:{model}:{block_size}:{hash_algo}:``, so replicas hashing differently never share keys):
- ``lru:{rank}``: a sorted set per rank; member = a block's 8-byte key (``_keys_blob``),
  score = its last use in microseconds (a shared monotonic tick, so a request's blocks get distinct
  scores, head highest: past capacity ``ZPOPMIN`` drops the tail of the least recent chain first,
  and entries older than the TTL are dropped and never matched);
- ``tick``: that clock; ``sess:{key}``: a session's rank, with the same TTL.

A lookup is ONE round trip: a Lua script finds, per rank, the longest held (and unexpired)
prefix by galloping then bisecting over block positions (about 2 log2(n) ``ZSCORE`` probes instead
of n), and reads the session's rank. Bisection assumes each rank's blocks form prefixes, which
the mirror maintains: blocks are evicted tail first and corrections trim a chain's suffix; a hole
in the middle of a chain (rare) can make the match overstate that chain.

Redis is never on a request's critical path for correctness: every update is also applied to a
local ``MemoryPrefixIndex``; when Redis fails, the store answers from that mirror, reports itself
down, and its ``RedisLink`` (``routing/redis_link.py``: the circuit breaker shared with every store
on the same Redis) probes it every ``retry_interval`` seconds off the event loop; once Redis
answers, the local mirror is pushed back (Redis may have restarted empty) before serving from Redis
again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from routing.index import Lookup
from routing.index.memory import MemoryPrefixIndex
from routing.redis_link import DEFAULT_RETRY_INTERVAL_S, ERRORS, RedisLink, fail_fast_client

log = logging.getLogger("prefixgate.index.redis")

DEFAULT_TTL_S = 3600.0
#: Short: a hung Redis must not stall the event loop, which calls the index synchronously.
DEFAULT_SOCKET_TIMEOUT_S = 0.25
#: Members per ZADD/ZREM call inside the scripts (Lua's unpack limit is about 8,000 values).
WRITE_CHUNK = 2000

_MATCH = """
local blob = ARGV[1]
local n = #blob / 8
local t = redis.call('TIME')
local cutoff = tonumber(t[1]) * 1000000 + tonumber(t[2]) - tonumber(ARGV[2])
local nb = tonumber(ARGV[3])
local out = {}
local function held(key, i)
  local s = redis.call('ZSCORE', key, string.sub(blob, i * 8 - 7, i * 8))
  return s and tonumber(s) >= cutoff
end
for k = 1, nb do
  local key = KEYS[k]
  local lo, hi = 0, n + 1
  -- gallop: 1, 2, 4, ... until a miss, then bisect between the last hit and that miss
  local probe = 1
  while probe <= n do
    if held(key, probe) then lo = probe; probe = probe * 2 else hi = probe; break end
  end
  if probe > n and lo < n then
    if held(key, n) then lo = n else hi = n end
  end
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if held(key, mid) then lo = mid else hi = mid end
  end
  out[k] = lo
end
local session = false
if #KEYS > nb then session = redis.call('GET', KEYS[nb + 1]) end
out[nb + 1] = session
return out
"""

_RECORD = """
local blob = ARGV[1]
local n = #blob / 8
local cap = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local start = math.max(now, tonumber(redis.call('GET', KEYS[2]) or '0') + 1)
redis.call('SET', KEYS[2], string.format('%d', start + n))
local i = 0
while i < n do
  local m = math.min(%(chunk)d, n - i)
  local args = {}
  for j = 1, m do
    local idx = i + j
    args[2 * j - 1] = start + n - idx
    args[2 * j] = string.sub(blob, idx * 8 - 7, idx * 8)
  end
  redis.call('ZADD', KEYS[1], unpack(args))
  i = i + m
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%d', now - ttl))
if cap >= 0 then
  local excess = redis.call('ZCARD', KEYS[1]) - cap
  if excess > 0 then redis.call('ZPOPMIN', KEYS[1], excess) end
end
redis.call('PEXPIRE', KEYS[1], math.floor(ttl / 1000))
return n
""".replace("%(chunk)d", str(WRITE_CHUNK // 2))

_REMOVE = """
local blob = ARGV[1]
local n = #blob / 8
local i = 0
while i < n do
  local m = math.min(%(chunk)d, n - i)
  local args = {}
  for j = 1, m do
    local idx = i + j
    args[j] = string.sub(blob, idx * 8 - 7, idx * 8)
  end
  redis.call('ZREM', KEYS[1], unpack(args))
  i = i + m
end
return n
""".replace("%(chunk)d", str(WRITE_CHUNK))


def _keys_blob(block_hashes: Sequence[bytes]) -> bytes:
    # A block's key is its digest's last 8 bytes, as vLLM's KV events do: a 64-bit collision between
    # two prefixes is negligible at fleet scale, and a 100k-token lookup sends 50 kB instead of 200 kB.
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
    ) -> None:
        """``link``: the Redis link shared with the other stores on this Redis (None: one of its own,
        over ``url``)."""
        self.url = url
        self.namespace = f"{prefix}:{model}:{block_size}:{hash_algo}:"
        self.ttl_s = ttl_s
        self.local = local if local is not None else MemoryPrefixIndex()
        self._owns_link = link is None
        self.link = link or RedisLink(fail_fast_client(url, socket_timeout), retry_interval, "redis index")
        self._client = self.link.client
        self._match = self._client.register_script(_MATCH)
        self._record = self._client.register_script(_RECORD)
        self._remove = self._client.register_script(_REMOVE)
        self._capacity: dict[str, int | None] = {}
        self._ranks: list[str] = []
        self._lru_keys: list[str] = []
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

    def _lru_key(self, rank: str) -> str:
        return f"{self.namespace}lru:{rank}"

    def _record_call(self, rank: str, block_hashes: Sequence[bytes]) -> tuple[list[str], list[bytes | int]]:
        """Keys and arguments of the record script: ``block_hashes`` (newest first) on ``rank``."""
        cap = self._capacity.get(rank)
        keys = [self._lru_key(rank), self.namespace + "tick"]
        return keys, [_keys_blob(block_hashes), -1 if cap is None else cap, int(self.ttl_s * 1e6)]

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
        sessions = self.local.sessions()
        if sessions:
            pipe = self._client.pipeline(transaction=False)
            for key, rank in sessions:
                pipe.set(f"{self.namespace}sess:{key}", rank, ex=int(self.ttl_s))
            pipe.execute()

    # -- PrefixIndex -----------------------------------------------------------------------------

    def set_capacity(self, rank: str, blocks: int | None) -> None:
        if rank not in self._capacity:
            self._ranks.append(rank)
            self._lru_keys.append(self._lru_key(rank))
        self._capacity[rank] = blocks
        self.local.set_capacity(rank, blocks)

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        return self.lookup(block_hashes, None).matches

    def lookup(self, block_hashes: Sequence[bytes], session_key: str | None) -> Lookup:
        local = self.local.lookup(block_hashes, session_key)
        if not self._available() or not self._ranks or (not block_hashes and not session_key):
            return local
        keys = list(self._lru_keys)
        if session_key:
            keys.append(f"{self.namespace}sess:{session_key}")
        try:
            out = self._match(
                keys=keys, args=[_keys_blob(block_hashes), int(self.ttl_s * 1e6), len(self._ranks)]
            )
        except ERRORS as exc:
            self.link.failed(exc)
            return local
        matches = {b: int(n) for b, n in zip(self._ranks, out, strict=False) if n}
        for rank, blocks in local.matches.items():  # this replica's writes not yet in Redis
            if blocks > matches.get(rank, 0):
                matches[rank] = blocks
        session = out[-1] if session_key and out[-1] else None
        session_rank = session.decode() if isinstance(session, bytes) else session
        return Lookup(matches, session_rank or local.session_rank)

    def record(self, rank: str, block_hashes: Sequence[bytes], *, counted: bool = False) -> None:
        if counted:
            # Counts live locally; Redis only needs to learn hashes that were not held yet.
            fresh = self.local.missing(rank, block_hashes)
            self.local.record(rank, block_hashes, counted=True)
            block_hashes = fresh if len(fresh) != len(block_hashes) else block_hashes
        else:
            self.local.record(rank, block_hashes)
        if not block_hashes:
            return
        if rank not in self._capacity:
            self.set_capacity(rank, None)
        keys, args = self._record_call(rank, block_hashes)
        self._submit(lambda: self._record(keys=keys, args=args))

    def remove(self, rank: str, block_hashes: Sequence[bytes], *, counted: bool = False) -> None:
        self.local.remove(rank, block_hashes, counted=counted)
        if counted:
            block_hashes = self.local.missing(rank, block_hashes)
        if not block_hashes:
            return
        keys, args = [self._lru_key(rank)], [_keys_blob(block_hashes)]
        self._submit(lambda: self._remove(keys=keys, args=args))

    def clear(self, rank: str) -> None:
        self.local.clear(rank)
        if not self._available():
            return
        try:
            self._client.delete(self._lru_key(rank))
        except ERRORS as exc:
            self.link.failed(exc)

    def set_session_rank(self, session_key: str, rank: str) -> None:
        self.local.set_session_rank(session_key, rank)
        key, ttl = f"{self.namespace}sess:{session_key}", max(1, int(self.ttl_s))
        self._submit(lambda: self._client.set(key, rank, ex=ttl))

    def forget_session(self, session_key: str) -> None:
        self.local.forget_session(session_key)
        key = f"{self.namespace}sess:{session_key}"
        self._submit(lambda: self._client.delete(key))

    def stats(self) -> dict[str, object]:
        local = self.local.stats()
        return {
            **local,
            "store": "redis",
            "redis_up": self.up,
            "redis_failures": self.failures,
            "redis_resyncs": self.resyncs,
        }

    def close(self) -> None:
        self.link.flush()
        if self._owns_link:
            self.link.close()
