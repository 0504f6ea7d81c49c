"""One rank's mirror kept as chain segments, so a request costs what changed, not its length.

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
``T + n - 1 - i`` (head newest) and eviction takes the least stamp first. Within a segment stamps
fall by one per block (``top`` at ``lo``), so a segment's oldest block is its last one; a heap of
segments by that stamp (stale entries skipped) finds the next to evict.

``where`` maps each held hash to ``segment id << 32 | position in the segment's chain``: an int,
which the garbage collector never has to traverse. A segment's blocks are read by slicing its chain
(``chain[lo:hi]``, O(hi - lo)), never ``islice`` (which steps over the ``lo`` blocks before them:
the whole conversation, on every turn of a long one). Not thread-safe: ``MemoryPrefixIndex`` locks.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

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

    __slots__ = ("capacity", "counts", "evicted", "heap", "next_id", "segments", "size", "tick", "where")

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.where: dict[bytes, int] = {}
        self.segments: dict[int, Segment] = {}
        #: (a segment's bottom stamp, its id); entries whose segment changed since are stale.
        self.heap: list[tuple[int, int]] = []
        #: Copies held, for hashes held more than once (KV events count every physical copy).
        self.counts: dict[bytes, int] = {}
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

    def order(self) -> list[bytes]:
        """Every held hash, least recently used first."""
        out: list[bytes] = []
        for seg in sorted(self.segments.values(), key=_bottom):
            out.extend(seg.chain[i] for i in range(seg.hi - 1, seg.lo - 1, -1))
        return out

    # -- writes -----------------------------------------------------------------------------------

    def record(self, chain: Sequence[bytes], counted: bool = False) -> None:
        """Touch ``chain`` (tail first, so its head is the most recent), adding what is not held,
        then evict past capacity. ``counted``: one more copy of each block."""
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
        self.size = 0

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
