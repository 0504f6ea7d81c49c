"""The in-memory prefix index: each rank's mirror as chain segments, bounded by the rank's pool.

``MemoryPrefixIndex`` keeps one mirror per rank (``RankChains``), its blocks as runs of consecutive
blocks of the chains that recorded them, so a request costs what changed, not its length: a lookup or
a record walks a prompt run by run, so a returning session costs a few compares for the prefix it
shares with what a rank holds (its agent's head, its own previous turns) plus its new tail, whatever
its length; a first turn costs its new blocks.

A segment is a run of consecutive blocks of one chain (``chain[lo:hi]``, a list the segment shares
with the request that recorded it) whose blocks were last touched by the same ``record``. Block
hashes are chained (a hash names its whole prefix), so two chains that hold the same hash at some
position agree on every block before it: comparing the *last* block a segment and a prompt have in
common tells whether all of them agree, and a bisection finds where they part. ``match`` and
``record`` therefore walk a prompt segment by segment (a returning session: its agent's shared head,
its own conversation, the new tail) instead of block by block; only new blocks are inserted one by
one, and only evicted or removed ones are deleted one by one.

Recency is exact, the same as one LRU list per rank touched tail first (vLLM's free queue): every
block has a stamp, ``record`` of an ``n``-block chain at tick ``T`` gives block ``i`` the stamp
``T + n - 1 - i`` (head newest) and eviction takes the least stamp first (past the rank's pool,
the tail of the least recently used chain goes first). Within a segment stamps fall by one per block
(``top`` at ``lo``), so a segment's oldest block is its last one; a heap of segments by that stamp
(stale entries skipped) finds the next to evict.

``where`` maps each held hash to ``segment id << 32 | position in the segment's chain``: an int,
which the garbage collector never has to traverse. A segment's blocks are read by slicing its chain
(``chain[lo:hi]``, O(hi - lo)), never ``islice`` (which steps over the ``lo`` blocks before them:
the whole conversation, on every turn of a long one). ``RankChains`` is not thread-safe:
``MemoryPrefixIndex`` locks.

Tiers (vLLM's KV offloading: KV events' ``medium``). A block is held when some copy of it is, on the
GPU or in a lower tier (``"CPU"``; any medium but ``GPU`` is kept apart by name). ``counts`` count the
copies of every tier together; ``offloaded[medium]`` the copies in that tier; so a block's GPU copies
are its copies minus its offloaded ones. Counted operations of a medium change that tier only:

- a GPU removal of a block with an offloaded copy is a demotion (still held, no longer on the GPU);
  a removal of a tier the mirror has no copy in is ignored (it never announced that copy);
- a lower tier's removal drops one copy there; a block leaves the mirror with its last copy;
- a clear of one medium drops that tier's copies only.

Invariants (``check_tiers``): every offloaded hash is held; no block has more offloaded copies
than copies (GPU copies >= 0); ``off_gpu`` is exactly the held blocks with no GPU copy (kept as the
tiers change, so a lookup counts a prompt's CPU-only blocks by one set intersection, in C).
Uncounted operations (routing's predictions) are GPU: an uncounted removal, eviction past capacity
and ``clear`` drop a block from every tier.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Sequence

from routing.index import GPU, Lookup
from tokenization.lru import LRU

_POS_BITS = 32
_POS_MASK = (1 << _POS_BITS) - 1


class Segment:
    """Blocks ``chain[lo:hi]``, stamps ``top`` (at ``lo``) down to ``bottom`` (at ``hi - 1``)."""

    __slots__ = ("chain", "hi", "id", "lo", "top")

    def __init__(self, sid: int, chain: Sequence[bytes], lo: int, hi: int, top: int) -> None:
        self.id = sid
        self.chain = chain
        self.lo = lo
        self.hi = hi
        self.top = top

    @property
    def bottom(self) -> int:
        return self.top - (self.hi - self.lo - 1)


def _agreeing(a: Sequence[bytes], i: int, b: Sequence[bytes], j: int, span: int) -> int:
    """How many leading blocks ``a[i:i+span]`` and ``b[j:j+span]`` share, given ``a[i] == b[j]``:
    chained hashes agree on a prefix, so one compare usually settles it and a bisection otherwise."""
    last = span - 1
    if last == 0 or a[i + last] == b[j + last]:
        return span
    lo, hi = 1, last  # a[i + lo - 1] agrees, a[i + hi] does not
    while lo < hi:
        mid = (lo + hi) // 2
        if a[i + mid] == b[j + mid]:
            lo = mid + 1
        else:
            hi = mid
    return lo


class RankChains:
    """The blocks one rank holds, their recency and copy counts (see the module docstring)."""

    __slots__ = (
        "capacity",
        "counts",
        "evicted",
        "heap",
        "next_id",
        "off_gpu",
        "offloaded",
        "segments",
        "size",
        "tick",
        "where",
    )

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.where: dict[bytes, int] = {}
        self.segments: dict[int, Segment] = {}
        #: (a segment's bottom stamp, its id); entries whose segment changed since are stale.
        self.heap: list[tuple[int, int]] = []
        #: Copies held, for hashes held more than once (KV events count every physical copy).
        self.counts: dict[bytes, int] = {}
        #: Copies held in each lower tier (medium -> hash -> copies); see the module docstring.
        self.offloaded: dict[str, dict[bytes, int]] = {}
        #: Held blocks with no GPU copy.
        self.off_gpu: set[bytes] = set()
        self.size = 0
        self.tick = 0
        self.next_id = 0
        self.evicted = 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self.where

    # -- reads ------------------------------------------------------------------------------------

    def held_prefix(self, chain: Sequence[bytes]) -> int:
        """Leading blocks of ``chain`` held here."""
        where, segments = self.where, self.segments
        n = len(chain)
        i = 0
        while i < n:
            v = where.get(chain[i])
            if v is None:
                break
            seg = segments[v >> _POS_BITS]
            p = v & _POS_MASK
            i += _agreeing(chain, i, seg.chain, p, min(seg.hi - p, n - i))
        return i

    def copies(self, block_hash: bytes) -> int:
        """Copies of ``block_hash`` held, every tier together (0: not held)."""
        return self.counts.get(block_hash, 1) if block_hash in self.where else 0

    def offloaded_copies(self, block_hash: bytes) -> int:
        """Copies of ``block_hash`` held outside the GPU."""
        return sum(tier.get(block_hash, 0) for tier in self.offloaded.values())

    def _one_tier(self) -> dict[bytes, int] | None:
        """The copies of vLLM's one lower tier (CPU), read directly per block of a KV event instead
        of through ``offloaded_copies``; None with no tier or several."""
        tiers = self.offloaded
        return next(iter(tiers.values())) if len(tiers) == 1 else None

    def on_gpu(self, block_hash: bytes) -> bool:
        """Whether some copy of the held ``block_hash`` is on the GPU."""
        return block_hash not in self.off_gpu

    def offloaded_only(self, chain: Sequence[bytes], held: int) -> int:
        """How many of ``chain``'s first ``held`` blocks (held here) have no GPU copy."""
        off_gpu = self.off_gpu
        if not off_gpu:
            return 0
        return len(off_gpu.intersection(chain if held == len(chain) else chain[:held]))

    def offloaded_only_count(self) -> int:
        """Held blocks with no GPU copy (in CPU memory only)."""
        return len(self.off_gpu)

    def check_tiers(self) -> None:
        """Raise AssertionError when a tier invariant of the module docstring is broken."""
        for medium, tier in self.offloaded.items():
            for h, n in tier.items():
                assert n > 0 and h in self.where, f"{medium} copy of a block not held"
        for h in set().union(*self.offloaded.values()) if self.offloaded else ():
            assert self.copies(h) >= self.offloaded_copies(h), "more offloaded copies than copies"
        computed = {h for h in self.where if self._without_gpu(h)}
        assert self.off_gpu == computed, "off_gpu is not the held blocks without a GPU copy"

    def _without_gpu(self, block_hash: bytes) -> bool:
        """From the counts: ``block_hash`` is held, and every copy of it is offloaded."""
        off = self.offloaded_copies(block_hash)
        return off > 0 and self.copies(block_hash) <= off

    def _retier(self, block_hashes: Sequence[bytes]) -> None:
        """Bring ``off_gpu`` up to date for these blocks (their copies changed)."""
        off_gpu = self.off_gpu
        if not self.offloaded:  # nothing offloaded: every held block has a GPU copy
            off_gpu.difference_update(block_hashes)
            return
        # ``_without_gpu`` inlined, for every block of every KV event
        one_tier, where, counts = self._one_tier(), self.where, self.counts
        for h in block_hashes:
            off = one_tier.get(h, 0) if one_tier is not None else self.offloaded_copies(h)
            if off and (counts.get(h, 1) if h in where else 0) <= off:
                off_gpu.add(h)
            else:
                off_gpu.discard(h)

    def order(self) -> list[bytes]:
        """Every held hash, least recently used first."""
        out: list[bytes] = []
        for seg in sorted(self.segments.values(), key=_bottom):
            out.extend(seg.chain[i] for i in range(seg.hi - 1, seg.lo - 1, -1))
        return out

    # -- writes -----------------------------------------------------------------------------------

    def record_offloaded(self, chain: Sequence[bytes], medium: str) -> None:
        """One more copy of each of ``chain``'s blocks (consecutive blocks of a chain), in the lower
        tier ``medium``. Blocks already held keep their recency (an offload is no use of them);
        runs of blocks not held yet are recorded as new."""
        tier = self.offloaded.setdefault(medium, {})
        counts, where = self.counts, self.where
        fresh_from = -1
        for i, h in enumerate(chain):
            if h in where:
                if fresh_from >= 0:
                    self.record(chain[fresh_from:i], counted=True)
                    fresh_from = -1
                    tier = self.offloaded.setdefault(medium, {})  # an eviction may have emptied it
                counts[h] = counts.get(h, 1) + 1
            elif fresh_from < 0:
                fresh_from = i
            tier[h] = tier.get(h, 0) + 1
        if fresh_from >= 0:
            self.record(chain[fresh_from:], counted=True)
            tier = self.offloaded.setdefault(medium, {})
        # recording may have evicted past capacity: what left the mirror leaves its tiers
        for h in [h for h in chain if h not in where]:
            tier.pop(h, None)
        if not tier:
            del self.offloaded[medium]
        self._retier(chain)

    def remove_copies(self, block_hashes: Sequence[bytes], medium: str = GPU) -> None:
        """One copy fewer of each block, in tier ``medium`` (see the module docstring)."""
        counts, where = self.counts, self.where
        tier = None if medium == GPU else self.offloaded.get(medium)
        if medium != GPU and tier is None:
            return
        taken: dict[bytes, int] = {}  # GPU copies this call already took, per block
        drop: list[bytes] = []
        one_tier = self._one_tier()
        off_gpu = self.off_gpu
        for h in block_hashes:
            if h not in where:
                continue
            if tier is None:
                off = one_tier.get(h, 0) if one_tier is not None else self.offloaded_copies(h)
                copies = counts.get(h, 1)
                gpu = copies - off - taken.get(h, 0)
                if gpu <= 0:
                    continue
                if off:  # so copies > 1: one on the GPU at least
                    # A demotion, nearly every GPU eviction behind a CPU tier: one copy fewer, the
                    # block stays held, off the GPU once its offloaded copies are all it has left
                    # (what ``remove`` and ``_retier`` below would do, in this one pass).
                    copies -= 1
                    if copies > 1:
                        counts[h] = copies
                    else:
                        del counts[h]
                    if copies <= off:
                        off_gpu.add(h)
                    continue
                taken[h] = taken.get(h, 0) + 1
            else:
                left = tier.get(h, 0) - 1
                if left < 0:
                    continue
                if left:
                    tier[h] = left
                else:
                    del tier[h]
            drop.append(h)
        if tier is not None and not tier:
            del self.offloaded[medium]
        self.remove(drop, counted=True)
        self._retier(drop)

    def clear_tier(self, medium: str) -> None:
        """Drop every copy held in tier ``medium``; blocks with no copy left go."""
        counts = self.counts
        if medium == GPU:
            left = {h: self.offloaded_copies(h) for h in self.where}
        else:
            tier = self.offloaded.pop(medium, None)
            if tier is None:
                return
            left = {h: counts.get(h, 1) - n for h, n in tier.items()}
        drop = [h for h, n in left.items() if n <= 0]
        for h, n in left.items():
            if n > 1:
                counts[h] = n
            elif n == 1:
                counts.pop(h, None)
        self.remove(drop)
        self._retier(list(left))

    def record(self, chain: Sequence[bytes], counted: bool = False) -> None:
        """Touch ``chain`` (tail first, so its head is the most recent), adding what is not held,
        then evict past capacity. ``counted``: one more copy of each block (on the GPU)."""
        n = len(chain)
        if not n:
            return
        top = self.tick + n - 1  # stamp of chain[0]
        self.tick += n
        where, segments, counts = self.where, self.segments, self.counts
        prev: Segment | None = None  # the segment touched last (it continues at chain[i] if aligned)
        i = 0
        while i < n:
            v = where.get(chain[i])
            if v is None:
                j = i + 1
                while j < n and chain[j] not in where:
                    j += 1
                prev = self._insert(chain, i, j, top - i, prev)
                i = j
                continue
            seg = segments[v >> _POS_BITS]
            p = v & _POS_MASK
            k = _agreeing(chain, i, seg.chain, p, min(seg.hi - p, n - i))
            seg = self._isolate(seg, p, p + k)
            seg.top = top - i
            heapq.heappush(self.heap, (seg.bottom, seg.id))
            if counted:
                for h in chain[i : i + k]:
                    counts[h] = counts.get(h, 1) + 1
            prev = seg
            i += k
        if counted and self.off_gpu:  # a GPU copy of each: none is CPU-only any more
            self.off_gpu.difference_update(chain)
        self._evict()

    def remove(self, block_hashes: Sequence[bytes], counted: bool = False) -> None:
        """Drop these blocks (``counted``: one copy of each; a block goes with its last copy)."""
        where, segments, counts = self.where, self.segments, self.counts
        run_seg: Segment | None = None
        run_lo = run_hi = 0
        for h in block_hashes:
            v = where.get(h)
            if v is None:
                continue
            if counts:
                copies = counts.get(h, 1)
                if counted and copies > 1:
                    counts[h] = copies - 1
                    continue
                if copies > 1:
                    del counts[h]
            seg, p = segments[v >> _POS_BITS], v & _POS_MASK
            if seg is run_seg and p == run_hi:
                run_hi += 1
                continue
            if run_seg is not None:
                self._cut(run_seg, run_lo, run_hi)
                # The cut may have moved this block into a new segment: look it up again.
                v = where[h]
                seg, p = segments[v >> _POS_BITS], v & _POS_MASK
            run_seg, run_lo, run_hi = seg, p, p + 1
        if run_seg is not None:
            self._cut(run_seg, run_lo, run_hi)

    def set_capacity(self, capacity: int | None) -> None:
        self.capacity = capacity
        self._evict()

    def clear(self) -> None:
        self.where.clear()
        self.segments.clear()
        self.heap.clear()
        self.counts.clear()
        self.offloaded.clear()
        self.off_gpu.clear()
        self.size = 0

    def _forget_tiers(self, gone: Sequence[bytes]) -> None:
        """Blocks that left the mirror leave every tier."""
        self.off_gpu.difference_update(gone)
        offloaded = self.offloaded
        for medium in list(offloaded):
            tier = offloaded[medium]
            for h in gone:
                tier.pop(h, None)
            if not tier:
                del offloaded[medium]

    # -- segments ---------------------------------------------------------------------------------

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def _point(self, seg: Segment, lo: int, hi: int) -> None:
        """``where`` entries of ``seg.chain[lo:hi]`` name ``seg``."""
        base = seg.id << _POS_BITS
        self.where.update(zip(seg.chain[lo:hi], range(base + lo, base + hi), strict=True))

    def _insert(self, chain: Sequence[bytes], i: int, j: int, top: int, prev: Segment | None) -> Segment:
        """Add the unheld ``chain[i:j]`` with ``chain[i]`` stamped ``top``: as the continuation of
        ``prev`` when ``prev`` (touched by this record) ends at ``chain[i - 1]`` at the same
        positions (its end equals ``i`` only then, as it covered as many blocks as ``chain`` moved
        on), else as a new segment."""
        if prev is not None and prev.hi == i:
            prev.chain = chain  # same positions: chain[prev.lo:i] are prev's blocks
            prev.hi = j
            seg = prev
        else:
            seg = Segment(self._new_id(), chain, i, j, top)
            self.segments[seg.id] = seg
        self._point(seg, i, j)
        self.size += j - i
        heapq.heappush(self.heap, (seg.bottom, seg.id))
        return seg

    def _split(self, seg: Segment, at: int) -> tuple[Segment, Segment]:
        """``seg`` as ``[lo, at)`` and ``[at, hi)``; the smaller part becomes a new segment."""
        lower_top = seg.top - (at - seg.lo)
        if at - seg.lo <= seg.hi - at:  # the upper part moves
            upper = Segment(self._new_id(), seg.chain, seg.lo, at, seg.top)
            seg.lo, seg.top = at, lower_top
            lower = seg
            self.segments[upper.id] = upper
            self._point(upper, upper.lo, at)
        else:
            lower = Segment(self._new_id(), seg.chain, at, seg.hi, lower_top)
            seg.hi = at
            upper = seg
            self.segments[lower.id] = lower
            self._point(lower, at, lower.hi)
        heapq.heappush(self.heap, (upper.bottom, upper.id))
        heapq.heappush(self.heap, (lower.bottom, lower.id))
        return upper, lower

    def _isolate(self, seg: Segment, lo: int, hi: int) -> Segment:
        """The segment holding exactly ``seg.chain[lo:hi]`` (splitting ``seg`` around it)."""
        if lo > seg.lo:
            seg = self._split(seg, lo)[1]
        if hi < seg.hi:
            seg = self._split(seg, hi)[0]
        return seg

    def _cut(self, seg: Segment, lo: int, hi: int) -> None:
        """Drop ``seg.chain[lo:hi]`` (held blocks of ``seg``)."""
        if lo > seg.lo and hi < seg.hi:  # from the middle: the part below stays a segment of its own
            seg = self._split(seg, hi)[0]
        where = self.where
        for h in seg.chain[lo:hi]:
            del where[h]
        if self.offloaded or self.off_gpu:
            self._forget_tiers(seg.chain[lo:hi])
        self.size -= hi - lo
        if lo == seg.lo and hi == seg.hi:
            del self.segments[seg.id]
        elif lo == seg.lo:
            seg.top -= hi - lo
            seg.lo = hi
        else:
            seg.hi = lo
            heapq.heappush(self.heap, (seg.bottom, seg.id))

    def _evict(self) -> None:
        """Drop least recently used blocks past capacity; keep the heap from growing stale."""
        capacity = self.capacity
        if capacity is not None and self.size > capacity:
            self._evict_blocks(self.size - capacity)
        if len(self.heap) > 4 * len(self.segments) + 64:
            self.heap = [(s.bottom, s.id) for s in self.segments.values()]
            heapq.heapify(self.heap)

    def _evict_blocks(self, excess: int) -> None:
        heap, segments, where, counts = self.heap, self.segments, self.where, self.counts
        while excess > 0:
            bottom, sid = heap[0]
            seg = segments.get(sid)
            if seg is None or seg.bottom != bottom:
                heapq.heappop(heap)
                continue
            # Stamp ranges of segments never overlap, so the oldest segment's blocks are all older
            # than any other's: take as many as needed from it at once.
            take = min(excess, seg.hi - seg.lo)
            for h in seg.chain[seg.hi - take : seg.hi]:
                del where[h]
                if counts:
                    counts.pop(h, None)
            if self.offloaded or self.off_gpu:
                self._forget_tiers(seg.chain[seg.hi - take : seg.hi])
            seg.hi -= take
            self.size -= take
            self.evicted += take
            excess -= take
            if seg.hi == seg.lo:
                del segments[sid]
                heapq.heappop(heap)
            else:
                heapq.heapreplace(heap, (seg.bottom, sid))


def _bottom(seg: Segment) -> int:
    return seg.bottom


#: Sessions remembered per process; the oldest is forgotten past this.
DEFAULT_MAX_SESSIONS = 100_000


class MemoryPrefixIndex:
    """``PrefixIndex`` in one process. Thread-safe (the KV-event subscriber writes from its thread)."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self._lock = threading.Lock()
        self._mirrors: dict[str, RankChains] = {}
        self._sessions: LRU[str, str] = LRU(max_sessions)

    # -- configuration ---------------------------------------------------------------------------

    def _mirror(self, rank: str) -> RankChains:
        mirror = self._mirrors.get(rank)
        if mirror is None:
            mirror = self._mirrors[rank] = RankChains()
        return mirror

    def set_capacity(self, rank: str, blocks: int | None) -> None:
        with self._lock:
            self._mirror(rank).set_capacity(blocks)

    @property
    def ranks(self) -> list[str]:
        return list(self._mirrors)

    # -- lookups ---------------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` each rank holds (ranks holding none left out)."""
        held: dict[str, int] = {}
        if not block_hashes:
            return held
        first = block_hashes[0]
        with self._lock:
            for name, mirror in self._mirrors.items():
                if first in mirror:
                    held[name] = mirror.held_prefix(block_hashes)
        return held

    def held_prefix(self, rank: str, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``block_hashes`` that ``rank`` holds (``match`` for one rank)."""
        with self._lock:
            mirror = self._mirrors.get(rank)
            return 0 if mirror is None or not block_hashes else mirror.held_prefix(block_hashes)

    def walk_match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """``match`` testing the blocks one by one: the reference the run-by-run walk must agree with."""
        held: dict[str, int] = {}
        with self._lock:
            for name, mirror in self._mirrors.items():
                n = 0
                for h in block_hashes:
                    if h not in mirror:
                        break
                    n += 1
                if n:
                    held[name] = n
        return held

    def lookup(self, block_hashes: Sequence[bytes], session_key: str | None) -> Lookup:
        matches, offloaded = self.match_tiers(block_hashes)
        return Lookup(matches, self.session_rank(session_key) if session_key else None, offloaded)

    def match_tiers(self, block_hashes: Sequence[bytes]) -> tuple[dict[str, int], dict[str, int]]:
        """``match``, and per rank how many of the matched blocks have no GPU copy (ranks with
        none left out): a rank's GPU blocks are its match minus those."""
        held: dict[str, int] = {}
        offloaded: dict[str, int] = {}
        if not block_hashes:
            return held, offloaded
        first = block_hashes[0]
        with self._lock:
            for name, mirror in self._mirrors.items():
                if first in mirror:
                    n = held[name] = mirror.held_prefix(block_hashes)
                    off = mirror.offloaded_only(block_hashes, n)
                    if off:
                        offloaded[name] = off
        return held, offloaded

    def session_rank(self, session_key: str) -> str | None:
        return self._sessions.get(session_key)

    def set_session_rank(self, session_key: str, rank: str) -> None:
        self._sessions.put(session_key, rank)

    def bind_session(self, session_key: str, rank: str, previous: str | None) -> str:
        # one process, one event loop: nobody else can have bound it since the lookup
        self._sessions.put(session_key, rank)
        return rank

    def forget_session(self, session_key: str) -> None:
        self._sessions.discard(session_key)

    def sessions(self) -> list[tuple[str, str]]:
        """Every remembered (session, rank), least recently used first (for resynchronization)."""
        sessions = self._sessions
        return [(key, rank) for key in sessions if (rank := sessions.peek(key)) is not None]

    # -- updates ---------------------------------------------------------------------------------

    def record(
        self, rank: str, block_hashes: Sequence[bytes], *, counted: bool = False, medium: str = GPU
    ) -> None:
        """Touch ``block_hashes`` (one chain, distinct hashes) on ``rank``: tail first, so that the
        head ends up the most recently used, then evict past capacity.

        Invariant: afterwards the chain's blocks are the most recent entries, in reverse chain order
        (head newest), and the other entries keep their relative order; so eviction, least recently
        used first, takes a chain's tail before its head.

        ``counted`` with a ``medium`` other than GPU (an offload: consecutive blocks of a chain):
        one more copy of each in that tier; blocks already held keep their recency.
        """
        with self._lock:
            if counted and medium != GPU:
                self._mirror(rank).record_offloaded(block_hashes, medium)
            else:
                self._mirror(rank).record(block_hashes, counted)

    def remove(
        self, rank: str, block_hashes: Sequence[bytes], *, counted: bool = False, medium: str = GPU
    ) -> None:
        with self._lock:
            mirror = self._mirrors.get(rank)
            if mirror is None:
                return
            if counted:
                mirror.remove_copies(block_hashes, medium)
            else:
                mirror.remove(block_hashes)

    def clear(self, rank: str, medium: str | None = None) -> None:
        with self._lock:
            mirror = self._mirrors.get(rank)
            if mirror is None:
                return
            if medium is not None:  # one tier emptied: the rank did not restart
                mirror.clear_tier(medium)
                return
            mirror.clear()
            for key in [k for k in self._sessions if self._sessions.peek(k) == rank]:
                self._sessions.discard(key)

    def held_by_tier(self, rank: str) -> tuple[int, int]:
        with self._lock:
            mirror = self._mirrors.get(rank)
            if mirror is None:
                return 0, 0
            offloaded = mirror.offloaded_only_count()
            return mirror.size - offloaded, offloaded

    def offloaded_among(self, rank: str, block_hashes: Sequence[bytes]) -> set[bytes]:
        """Those of ``block_hashes`` that ``rank`` holds in CPU memory only (no GPU copy)."""
        with self._lock:
            mirror = self._mirrors.get(rank)
            if mirror is None or not mirror.off_gpu:
                return set()
            return mirror.off_gpu.intersection(block_hashes)

    def offloaded_blocks(self, rank: str) -> list[bytes]:
        """Every block ``rank`` holds in CPU memory only (a snapshot)."""
        with self._lock:
            mirror = self._mirrors.get(rank)
            return [] if mirror is None else list(mirror.off_gpu)

    def blocks(self, rank: str) -> list[bytes]:
        """``rank``'s mirrored hashes, least recently used first."""
        with self._lock:
            mirror = self._mirrors.get(rank)
            return [] if mirror is None else mirror.order()

    def missing(self, rank: str, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Those of ``block_hashes`` that ``rank``'s mirror does not hold."""
        with self._lock:
            mirror = self._mirrors.get(rank)
            if mirror is None:
                return list(block_hashes)
            return [h for h in block_hashes if h not in mirror]

    def event_writer_of(self) -> frozenset[str] | None:
        return None

    def stats(self) -> dict[str, object]:
        with self._lock:
            mirrors = list(self._mirrors.values())
            distinct = (
                len(mirrors[0].where) if len(mirrors) == 1 else len(set().union(*(m.where for m in mirrors)))
            )
            return {
                "store": "memory",
                "distinct_blocks": distinct,
                "sessions": len(self._sessions),
                "backends": {
                    name: {
                        "blocks": m.size,
                        "segments": len(m.segments),
                        "capacity": m.capacity,
                        "evicted": m.evicted,
                        "offloaded_only": m.offloaded_only_count(),
                    }
                    for name, m in self._mirrors.items()
                },
            }
