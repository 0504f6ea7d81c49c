"""Exact mirror from vLLM KV-cache events: one ZMQ SUB per rank, applied to that rank's mirror.

Frames: ``[topic, seq (8-byte big-endian), msgpack [ts, events, dp_rank]]``; events are maps with a
``type`` key (vLLM 0.33) or positional arrays led by the type name (0.11); both are decoded.
``BlockStored`` hashes are the rank's uint64s; they are mapped to prefixgate's own chain by hashing
the event's token ids from the mapped parent, so the mirror is keyed exactly like the prompts
routing looks up, whatever hash seed the rank runs with. A sequence gap (missed batches, or a late
start) is filled from the rank's replay socket (DEALER ``[b"", start_seq]``); batches the SUB socket
queued while a replay applied them are skipped; live numbers that go back mean the rank restarted,
so its mirror is cleared and refilled from the new publisher's first batch (``BatchOrder``).

A lower tier's size (vLLM's offloading connector sizes its CPU tier in its own configuration, which
the rank does not publish) is learned from the events: the tier is full when it first evicts (a
``BlockRemoved`` of that medium; a load back to the GPU keeps the CPU copy, so such a removal is
never a reload), and its size is then the blocks the mirror had it hold just before (at most one
block over, for a rank that stores a block before evicting for it, as the simulator does); the
largest seen is kept (``RankMirror.tier_full_blocks``, told through ``on_tier_full``). Every
replica learns it from its own subscription to the same events.

The subscriber runs in its own thread; the index it writes to is thread-safe.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, cast

import msgspec
import zmq

from routing.index import GPU, PrefixIndex
from tokenization.block_hash import ChainHasher, kv_event_hash

log = logging.getLogger("prefixgate.kv_events")

END_SEQ = b"\xff" * 8
_DECODE = msgspec.msgpack.Decoder()


class BlockStored(msgspec.Struct, tag_field="type", tag=True, gc=False):
    """Blocks a rank cached in ``medium``, with their tokens (vLLM 0.33's map form; 0.11's arrays are
    read by the subclass below)."""

    type: ClassVar[str] = "BlockStored"
    #: The rank's uint64s: ints once decoded (a digest on the wire is read as one, ``__post_init__``;
    #: typed Any so that msgspec takes either and the mirror's loop reads ints without a cast call).
    block_hashes: list[Any]
    parent_block_hash: Any = None
    token_ids: list[int] | None = None
    block_size: int | None = None
    lora_id: int | None = None
    #: Storage tier (vLLM's ``medium``: "GPU", "CPU", ...); missing or nil is vLLM's default, GPU.
    medium: str | None = GPU

    def __post_init__(self) -> None:  # runs as msgspec decodes: the mirror reads one form
        if self.medium is None:
            self.medium = GPU
        self.block_hashes = _hashes(self.block_hashes)
        if isinstance(self.parent_block_hash, bytes):
            self.parent_block_hash = kv_event_hash(self.parent_block_hash)


class BlockRemoved(msgspec.Struct, tag_field="type", tag=True, gc=False):
    """Blocks a rank evicted from ``medium`` (vLLM sends one per block)."""

    type: ClassVar[str] = "BlockRemoved"
    block_hashes: list[Any]  # ints once decoded, as BlockStored's
    medium: str | None = GPU

    def __post_init__(self) -> None:
        if self.medium is None:
            self.medium = GPU
        self.block_hashes = _hashes(self.block_hashes)


class AllBlocksCleared(msgspec.Struct, tag_field="type", tag=True, gc=False):
    """Every block of ``medium`` is gone; vLLM's own classes carry no medium here: None, every tier."""

    type: ClassVar[str] = "AllBlocksCleared"
    medium: str | None = None


# vLLM 0.11 sends the same events as positional arrays led by their type name (lora_id before medium).
class _BlockStoredArray(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _BlockRemovedArray(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _AllBlocksClearedArray(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared
_ArrayEvent = _BlockStoredArray | _BlockRemovedArray | _AllBlocksClearedArray


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


def _hashes(raw: list[Any]) -> list[Any]:
    """An event's block hashes as vLLM's uint64s. Some connectors' events (vLLM's offloading
    connector in some versions) carry the digests themselves: their last 8 bytes, as vLLM's
    ``maybe_convert_block_hash`` makes of them. One connector sends one kind: a list of uint64s is
    taken as it is, without a look at each hash."""
    if not raw or type(raw[0]) is int:
        return raw
    return [kv_event_hash(h) if isinstance(h, bytes) else h for h in raw]


def decode_event(raw: Any) -> KVEvent | None:
    """One event from its 0.33 map or 0.11 positional array (None: a type the mirror does not use)."""
    try:
        form: Any = KVEvent if isinstance(raw, dict) else _ArrayEvent  # a union, not a class
        return cast(KVEvent, msgspec.convert(raw, form))
    except msgspec.ValidationError:
        return None


class EventDecoder:
    """Decodes a rank's payloads straight into typed events, trying first the form its last batch
    had (msgspec builds them in C: about half the time of decoding maps and building events from
    them in Python, on a feed recorded behind two ranks with a CPU tier)."""

    _TYPED: tuple[msgspec.msgpack.Decoder[Any], ...] = (
        msgspec.msgpack.Decoder(_MapBatch),
        msgspec.msgpack.Decoder(_ArrayBatch),
    )

    def __init__(self) -> None:
        self._order = self._TYPED

    def decode(self, payload: bytes) -> tuple[float, list[KVEvent], int | None]:
        """``(ts, events, data_parallel_rank)`` of one msgpack payload."""
        for decoder in self._order:
            try:
                batch = decoder.decode(payload)
            except msgspec.ValidationError:
                continue
            if decoder is not self._order[0]:
                self._order = (decoder, *(d for d in self._TYPED if d is not decoder))
            return batch.ts, cast(list[KVEvent], batch.events), batch.data_parallel_rank
        # An event type neither form knows (a newer vLLM's): the batch event by event, those skipped.
        raw = _DECODE.decode(payload)
        events = [e for e in map(decode_event, raw[1]) if e is not None]
        return float(raw[0]), events, raw[2] if len(raw) > 2 else None


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent], int | None]:
    """``(ts, events, data_parallel_rank)`` of one msgpack payload, either form."""
    return EventDecoder().decode(payload)


class RankMirror:
    """Applies one rank's events to its mirror in ``index``, keeping the uint64 -> own-hash map."""

    def __init__(
        self,
        rank: str,
        index: PrefixIndex,
        hasher: ChainHasher,
        on_applied: Callable[[Mapping[str, int]], None] | None = None,
        on_stored: Callable[[str, Sequence[bytes]], None] | None = None,
        on_tier_full: Callable[[str, int], None] | None = None,
    ) -> None:
        """``on_applied``: called once per batch with how many events of each type it applied (a
        labelled counter's increment per event was 6 % of a proxy's CPU behind ranks with a CPU tier
        and 16-token blocks, py-spy); ``on_stored``: with the rank and the
        own hashes of each run of blocks stored on the GPU, once the mirror holds them (a copy to a
        lower tier is of a block the GPU stored before); ``on_tier_full``: with a
        lower tier's medium and its size in tokens, each time it evicts holding more than ever
        before (module docstring)."""
        self.rank = rank
        self.index = index
        self.hasher = hasher
        self.on_applied = on_applied
        self.on_stored = on_stored
        self.on_tier_full = on_tier_full
        #: Per lower medium, the blocks with a copy there (the tier's fill, as its events tell it).
        self.tier_blocks: collections.Counter[str] = collections.Counter()
        #: Per lower medium, the most blocks it held when it evicted: its size (module docstring).
        self.tier_full_blocks: dict[str, int] = {}
        #: rank's uint64 -> [own hash, GPU copies, {lower medium: copies} or None]
        self._own: dict[int, list[Any]] = {}
        self.unmapped = 0
        self.applied = 0

    def apply(self, events: Sequence[KVEvent]) -> None:
        # vLLM sends one BlockRemoved per evicted block: a run of them (of one medium) is applied as
        # one removal, so a shared index gets one write for the run, not one per block (in order:
        # any other event ends the run; an empty run writes nothing)
        removed: list[int] = []
        removed_medium = GPU
        applied: dict[str, int] = {}
        for event in events:
            if isinstance(event, BlockRemoved):
                medium = event.medium or GPU
                if medium != removed_medium:
                    self._removed(removed, removed_medium)
                    removed, removed_medium = [], medium
                removed.extend(event.block_hashes)
            elif isinstance(event, BlockStored):
                self._removed(removed, removed_medium)
                removed = []
                self._stored(event)
            elif isinstance(event, AllBlocksCleared):
                if event.medium is None:
                    removed = []  # cleared with everything else
                    self.reset()
                else:
                    self._removed(removed, removed_medium)
                    removed = []
                    self._cleared(event.medium)
            else:
                continue
            kind = event.type
            applied[kind] = applied.get(kind, 0) + 1
        self._removed(removed, removed_medium)
        if applied:
            self.applied += sum(applied.values())
            if self.on_applied is not None:
                self.on_applied(applied)

    def reset(self) -> None:
        self._own.clear()
        self.tier_blocks.clear()
        self.index.clear(self.rank)

    def _cleared(self, medium: str) -> None:
        """Every copy in tier ``medium`` is gone; the other tiers keep theirs."""
        table = self._own
        for u64 in list(table):
            entry = table[u64]
            if medium == GPU:
                entry[1] = 0
            elif entry[2] is not None:
                entry[2].pop(medium, None)  # the tier's fill is zeroed below
                if not entry[2]:
                    entry[2] = None
            if entry[1] == 0 and entry[2] is None:
                del table[u64]
        if medium != GPU:
            self.tier_blocks.pop(medium, None)
        self.index.clear(self.rank, medium)

    def _stored(self, event: BlockStored) -> None:
        size = self.hasher.block_size
        medium = event.medium or GPU
        hashes: list[int] = event.block_hashes
        tokens = event.token_ids or []
        if not tokens and hashes:
            # vLLM's offloading connector announces the blocks it copies to CPU by hash alone: blocks
            # the mirror knows from their GPU store. One event's blocks are consecutive blocks of a
            # chain, so each run of known ones is recorded as one.
            self._stored_known(hashes, medium)
            return
        if event.block_size not in (None, size) or len(tokens) != size * len(hashes):
            self.unmapped += len(hashes)
            return
        table = self._own
        # Blocks the mirror maps already (a prefix loaded back from a lower tier, or stored again
        # after its eviction, the most of a rank's stores behind a CPU tier) keep their own hashes:
        # only the blocks after that known run are hashed from their tokens.
        entries: list[list[Any]] = []
        for u64 in hashes:
            entry = table.get(u64)
            if entry is None:
                break
            entries.append(entry)
        own: list[bytes] = [entry[0] for entry in entries]
        known = len(own)
        if known < len(hashes):
            if known:
                parent: bytes | None = own[-1]
            elif event.parent_block_hash is None:
                parent = None
            else:
                mapped = table.get(event.parent_block_hash)
                if mapped is None:  # its chain began before anything we saw: cannot be keyed
                    self.unmapped += len(hashes)
                    return
                parent = mapped[0]
            rest = tokens[known * size :] if known else tokens
            if parent is None:
                own.extend(self.hasher.hash_blocks(rest))
            else:
                # Continue the chain from the mapped parent: hash_blocks skips the first (dummy) block.
                own.extend(self.hasher.hash_blocks([0] * size + rest, start_block=1, parent=parent))
            for u64, h in zip(hashes[known:], own[known:], strict=True):
                entry = table.get(u64)
                if entry is None:
                    entry = table[u64] = [h, 0, None]
                entries.append(entry)
        for entry in entries:
            if medium == GPU:
                entry[1] += 1
            else:
                self._copy(entry, medium, 1)
        self._record(own, medium)

    def _stored_known(self, hashes: Sequence[int], medium: str) -> None:
        table = self._own
        run: list[bytes] = []
        for u64 in hashes:
            entry = table.get(u64)
            if entry is None:
                self.unmapped += 1
                self._record(run, medium)
                run = []
                continue
            self._copy(entry, medium, 1)
            run.append(entry[0])
        self._record(run, medium)

    def _record(self, own: list[bytes], medium: str) -> None:
        if not own:
            return
        self.index.record(self.rank, own, counted=True, medium=medium)
        if self.on_stored is not None and medium == GPU:
            self.on_stored(self.rank, own)

    def _removed(self, hashes: Sequence[int], medium: str) -> None:
        table = self._own
        held = self.tier_blocks[medium] if medium != GPU else 0
        gone: list[bytes] = []
        gpu = medium == GPU
        for u64 in hashes:
            entry = table.get(u64)
            if entry is None:
                continue
            if gpu:  # ``_copy`` inlined for the GPU, one per block vLLM evicts
                if not entry[1]:
                    continue
                entry[1] -= 1
            elif not self._copy(entry, medium, -1):
                continue
            gone.append(entry[0])
            if not entry[1] and entry[2] is None:
                del table[u64]
        if gone:
            self.index.remove(self.rank, gone, counted=True, medium=medium)
            if medium != GPU:
                self._tier_evicted(medium, held)

    def _tier_evicted(self, medium: str, held: int) -> None:
        """Tier ``medium`` evicted holding ``held`` blocks just before: it is full at that size."""
        if held <= self.tier_full_blocks.get(medium, 0):
            return
        self.tier_full_blocks[medium] = held
        if self.on_tier_full is not None:
            self.on_tier_full(medium, held * self.hasher.block_size)

    def _copy(self, entry: list[Any], medium: str, delta: int) -> bool:
        """``_count``, keeping ``tier_blocks`` (a lower tier's blocks with a copy) up to date."""
        if medium == GPU:
            return _count(entry, medium, delta)
        before = entry[2].get(medium, 0) if entry[2] is not None else 0
        if not _count(entry, medium, delta):
            return False
        after = entry[2].get(medium, 0) if entry[2] is not None else 0
        if not before and after:
            self.tier_blocks[medium] += 1
        elif before and not after:
            self.tier_blocks[medium] -= 1
        return True


def _count(entry: list[Any], medium: str, delta: int) -> bool:
    """Add ``delta`` copies in ``medium`` to a uint64's entry; False (unchanged) when a removal
    names a tier the block has no copy in."""
    if medium == GPU:
        if entry[1] + delta < 0:
            return False
        entry[1] += delta
        return True
    lower: dict[str, int] | None = entry[2]
    copies = (lower or {}).get(medium, 0) + delta
    if copies < 0:
        return False
    if lower is None:
        lower = entry[2] = {}
    if copies:
        lower[medium] = copies
    else:
        lower.pop(medium, None)
        if not lower:
            entry[2] = None
    return True


class Verdict(enum.Enum):
    """What a batch received on the SUB socket is, given what was applied and received before."""

    NEXT = "next"  # the batch after the last applied: apply it
    GAP = "gap"  # batches between the last applied and this one were missed: replay them first
    COPY = "copy"  # a replay already applied it (the SUB queued it meanwhile): skip it
    RESTART = "restart"  # the SUB's own sequence went back: the publisher started over


class BatchOrder:
    """The sequence numbers of one rank's batches: the newest applied, the newest received live.

    A replay applies batches that the SUB socket may also have queued meanwhile; those arrive
    later, with numbers at or below the newest applied, and are copies. The publisher numbers its
    batches in order, so the SUB's own numbers only go up; one that does not (at or below the newest
    received live) means the publisher started over: the rank restarted and its cache is empty.

    Invariants: ``applied`` only grows, except at a restart, where it starts over at -1 (nothing of
    the new publisher applied); ``received`` is the number of the newest batch received live (-1:
    none). A restart before the first live batch is not seen (nothing to compare with).
    """

    __slots__ = ("applied", "received")

    def __init__(self) -> None:
        self.applied = -1
        self.received = -1

    def received_live(self, seq: int) -> Verdict:
        """Classify ``seq``, just received on the SUB socket, and remember it."""
        restarted = seq <= self.received
        self.received = seq
        if restarted:
            self.applied = -1
            return Verdict.RESTART
        if seq <= self.applied:
            return Verdict.COPY
        return Verdict.NEXT if seq == self.applied + 1 else Verdict.GAP

    def applied_through(self, seq: int) -> None:
        """Batch ``seq`` was applied (or given up on): the next expected is ``seq + 1``."""
        self.applied = seq


class KVEventSubscriber:
    """A background thread: SUB to one rank's publisher, replay on gaps, apply to its mirror."""

    def __init__(
        self,
        mirror: RankMirror,
        endpoint: str,
        replay_endpoint: str | None = None,
        topic: str = "",
        replay_timeout: float = 2.0,
        zmq_context: zmq.Context | None = None,
        on_fault: Callable[[str, int], None] | None = None,
    ) -> None:
        self.mirror = mirror
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.replay_timeout = replay_timeout
        self._zmq = zmq_context or zmq.Context.instance()
        #: called with ("gap" | "restart" | "error" | "replay_drop", 1), and with ("unmapped",
        #: blocks) for stored blocks that could not be keyed (``faults`` counts them all)
        self.on_fault = on_fault
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"kv-sub-{mirror.rank}", daemon=True)
        self.order = BatchOrder()
        self.decoder = EventDecoder()
        self.batches = 0
        self.replayed = 0
        #: Faults so far by kind (the ``on_fault`` kinds): gaps, restarts, errors, unmapped blocks.
        self.faults: collections.Counter[str] = collections.Counter()
        self.connected = threading.Event()

    @property
    def gaps(self) -> int:
        return self.faults["gap"]

    @property
    def restarts(self) -> int:
        return self.faults["restart"]

    @property
    def errors(self) -> int:
        return self.faults["error"]

    @property
    def last_seq(self) -> int:
        """The newest batch applied (-1: none yet)."""
        return self.order.applied

    def start(self, wait_s: float = 5.0) -> KVEventSubscriber:
        """Start the thread; return once it caught up on what the rank published before (its
        replay) or after ``wait_s`` seconds (0: at once; ``connected`` tells when)."""
        self._thread.start()
        if wait_s > 0:
            self.connected.wait(wait_s)
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        sub = self._zmq.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        # A rank that is down is retried at 0.1 s doubling to 1 s, not 10 times a second for as
        # long as it is gone: its port may meanwhile be another server's, which logs each greeting
        # as an invalid request. Back up, a rank is heard from within a second.
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sub.connect(self.endpoint)
        try:
            if self.replay_endpoint is not None:
                # Catch up on what the rank published before we subscribed; batches that arrive on
                # the SUB meanwhile are queued and skipped by sequence number.
                self._replay(self.order.applied + 1, 1 << 63)
            self.connected.set()
            while not self._stop.is_set():
                if not sub.poll(100):
                    continue
                frames = sub.recv_multipart()
                if len(frames) < 3:
                    continue
                self._handle(int.from_bytes(frames[-2], "big"), frames[-1])
        except Exception:  # a dead subscriber must be visible: routing then runs on predictions
            log.exception("KV event subscriber for %s failed", self.mirror.rank)
        finally:
            sub.close(0)

    def _handle(self, seq: int, payload: bytes) -> None:
        verdict = self.order.received_live(seq)
        if verdict is Verdict.COPY:
            return
        try:
            if verdict is Verdict.RESTART:
                # The publisher started over: the rank restarted and its cache is empty.
                self._fault("restart")
                self.mirror.reset()
            if seq > self.order.applied + 1:  # a gap, or a restart the SUB joined late
                self._fault("gap")
                self._replay(self.order.applied + 1, seq)
            self._apply(seq, payload)
        except Exception:
            # One batch that cannot be applied must not end the feed (the rank would then be
            # mirrored by a frozen index for good): the mirror is no longer trustworthy, so it
            # starts over from the batches that follow, an under-estimate that the next turns mend.
            self._fault("error")
            log.exception("KV events %s: batch %d not applied; mirror cleared", self.mirror.rank, seq)
            self.mirror.reset()
            self.order.applied_through(seq)

    def _fault(self, fault: str, count: int = 1) -> None:
        self.faults[fault] += count
        if self.on_fault is not None:
            self.on_fault(fault, count)

    def _apply(self, seq: int, payload: bytes) -> None:
        _, events, _ = self.decoder.decode(payload)
        mirror = self.mirror
        unmapped = mirror.unmapped
        mirror.apply(events)
        self.order.applied_through(seq)
        self.batches += 1
        if mirror.unmapped > unmapped:
            self._fault("unmapped", mirror.unmapped - unmapped)

    def _replay(self, start: int, until: int) -> None:
        """Fetch and apply batches ``start .. until-1`` from the replay socket, if there is one.

        vLLM's replay ROUTER sends every buffered batch at once, with no flow control: past its
        send high-water mark (1,000 messages) it drops what the receiver has not taken yet, silently.
        So a replay's batches are applied only in order (a batch past a hole is not applied, which
        would key later blocks on a chain with a missing link), and a replay with a hole asks again
        from the hole; each answer brings at least what fits under the mark, so the tries end."""
        endpoint = self.replay_endpoint
        if endpoint is None:
            log.warning(
                "KV events %s: batches %d..%d lost (no replay socket)", self.mirror.rank, start, until - 1
            )
            return
        while True:
            received, ended = self._fetch(endpoint, self.order.applied + 1)
            before, hole = self.order.applied, False
            for seq, payload in received:
                if seq <= self.order.applied:
                    continue
                if seq >= until:
                    break
                if seq != self.order.applied + 1:
                    hole = True  # the ROUTER dropped what came before it
                    break
                self._apply(seq, payload)
                self.replayed += 1
            if self.order.applied >= until - 1 or (ended and not hole):
                return
            if self.order.applied == before:
                log.warning(
                    "KV events %s: replay from %d brought nothing in order; going on from the live feed",
                    self.mirror.rank,
                    before + 1,
                )
                return
            self._fault("replay_drop")

    def _fetch(self, endpoint: str, start: int) -> tuple[list[tuple[int, bytes]], bool]:
        """Every batch the replay socket at ``endpoint`` sends from ``start`` (received before any is
        applied, so the ROUTER's queue drains at the socket's pace), and whether its end marker came."""
        dealer = self._zmq.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)  # our side never pushes back: the ROUTER would drop
        dealer.connect(endpoint)
        received: list[tuple[int, bytes]] = []
        # The publisher answers between its other work; then it sends everything in one burst, so a
        # pause in it means the rest (the end marker too) was dropped: asked again, sooner.
        wait_ms = int(self.replay_timeout * 1000)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            while dealer.poll(wait_ms if not received else max(wait_ms // 10, 1)):
                frames = dealer.recv_multipart()
                # [b"", topic, seq, payload] (0.33) or [b"", seq, payload] (0.11)
                seq_frame, payload = frames[-2], frames[-1]
                if seq_frame == END_SEQ:
                    return received, True
                received.append((int.from_bytes(seq_frame, "big"), payload))
            rank = self.mirror.rank
            if received:  # a pause: the rest is asked for again from the first missing one
                log.debug("KV events %s: replay from %d paused after %d", rank, start, len(received))
            else:
                log.warning("KV events %s: replay from %d got no answer", rank, start)
            return received, False
        finally:
            dealer.close(0)
