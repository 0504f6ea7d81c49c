"""The chain-segment mirror answers exactly as one LRU of blocks per rank (the previous design).

The reference below is that design in its plainest form: per rank an ordered dict of hash -> copies,
``record`` moving each block to the end tail first, ``remove`` dropping blocks (counted: a copy),
capacity evicting from the front, ``match`` walking block by block. Random operations over a forest
of chains that share prefixes (an agent's head, forks, segments that do not start at block 0, holes)
must leave both with the same recency order, the same matches and the same sizes.
"""

from __future__ import annotations

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.index.memory import MemoryPrefixIndex
from tests.routing.conftest import chain

RANKS = ("r0", "r1", "r2")
_A = chain("a", 40)
_B = _A[:12] + chain("b", 28, _A[11])
_C = _B[:20] + chain("c", 20, _B[19])
_D = _A[:3] + chain("d", 30, _A[2])
_E = chain("e", 25)
CHAINS = (_A, _B, _C, _D, _E)


class Reference:
    def __init__(self) -> None:
        self.lru: dict[str, OrderedDict[bytes, int]] = {}
        self.capacity: dict[str, int | None] = {}

    def _mirror(self, rank: str) -> OrderedDict[bytes, int]:
        self.capacity.setdefault(rank, None)
        return self.lru.setdefault(rank, OrderedDict())

    def set_capacity(self, rank: str, blocks: int | None) -> None:
        self._mirror(rank)
        self.capacity[rank] = blocks
        self._evict(rank)

    def record(self, rank: str, hashes: list[bytes], counted: bool) -> None:
        lru = self._mirror(rank)
        for h in reversed(hashes):
            if h in lru:
                lru[h] += int(counted)
                lru.move_to_end(h)
            else:
                lru[h] = 1
        self._evict(rank)

    def remove(self, rank: str, hashes: list[bytes], counted: bool) -> None:
        lru = self.lru.get(rank)
        if lru is None:
            return
        for h in hashes:
            if h not in lru:
                continue
            if counted and lru[h] > 1:
                lru[h] -= 1
            else:
                del lru[h]

    def clear(self, rank: str) -> None:
        if rank in self.lru:
            self.lru[rank].clear()

    def _evict(self, rank: str) -> None:
        lru, cap = self.lru[rank], self.capacity[rank]
        while cap is not None and len(lru) > cap:
            lru.popitem(last=False)

    def match(self, hashes: list[bytes]) -> dict[str, int]:
        out = {}
        for rank, lru in self.lru.items():
            n = 0
            while n < len(hashes) and hashes[n] in lru:
                n += 1
            if n:
                out[rank] = n
        return out


@st.composite
def operation(draw: st.DrawFn) -> tuple:
    kind = draw(st.sampled_from(["record"] * 6 + ["remove"] * 2 + ["capacity", "clear"]))
    rank = draw(st.sampled_from(RANKS))
    base = draw(st.sampled_from(CHAINS))
    start = draw(st.sampled_from([0, 0, 0, 1, 5, 13]))
    end = draw(st.integers(start + 1, len(base)))
    counted = draw(st.booleans())
    if kind == "remove":
        shape = draw(st.sampled_from(["suffix", "one", "some", "shuffled"]))
        picked = base[start:end]
        if shape == "one":
            picked = [draw(st.sampled_from(base))]
        elif shape == "some":
            picked = [h for h in base if draw(st.booleans())]
        elif shape == "shuffled":
            picked = draw(st.permutations(base[start:end]))
        return ("remove", rank, list(picked), counted)
    if kind == "capacity":
        return ("capacity", rank, draw(st.one_of(st.none(), st.integers(0, 60))), counted)
    return (kind, rank, base[start:end], counted)


def _apply(index: MemoryPrefixIndex, ref: Reference, op: tuple) -> None:
    kind, rank, arg, counted = op
    if kind == "record":
        index.record(rank, arg, counted=counted)
        ref.record(rank, arg, counted)
    elif kind == "remove":
        index.remove(rank, arg, counted=counted)
        ref.remove(rank, arg, counted)
    elif kind == "capacity":
        index.set_capacity(rank, arg)
        ref.set_capacity(rank, arg)
    else:
        index.clear(rank)
        ref.clear(rank)


def _probes() -> list[list[bytes]]:
    probes = [list(c) for c in CHAINS]
    probes += [c[:n] for c in CHAINS for n in (1, 7, 15)]
    probes.append(_A[:5] + chain("unseen", 4, _A[4]))
    return probes


@settings(max_examples=400, deadline=None)
@given(st.lists(operation(), max_size=45), st.lists(st.integers(5, 80), min_size=3, max_size=3))
def test_random_operations_leave_the_same_order_matches_and_sizes(ops: list, capacities: list) -> None:
    index = MemoryPrefixIndex()
    ref = Reference()
    for rank, cap in zip(RANKS, capacities, strict=True):
        index.set_capacity(rank, cap)
        ref.set_capacity(rank, cap)
    for op in ops:
        _apply(index, ref, op)
        for rank in RANKS:
            assert index.blocks(rank) == list(ref.lru[rank]), (rank, op)
        stats = index.stats()["backends"]
        assert {r: s["blocks"] for r, s in stats.items()} == {r: len(v) for r, v in ref.lru.items()}
        for probe in _probes():
            assert index.match(probe) == ref.match(probe) == index.walk_match(probe)
    for rank in RANKS:
        assert index.missing(rank, _A) == [h for h in _A if h not in ref.lru[rank]]


@settings(max_examples=150, deadline=None)
@given(st.lists(operation(), max_size=30))
def test_counted_copies_leave_with_the_last_one(ops: list) -> None:
    """Unbounded mirrors fed only counted records and removals (KV events), as exact ranks are."""
    index = MemoryPrefixIndex()
    ref = Reference()
    for kind, rank, arg, _ in ops:
        if kind in ("record", "remove"):
            _apply(index, ref, (kind, rank, arg, True))
    for rank in ref.lru:
        assert index.blocks(rank) == list(ref.lru[rank])
    for probe in _probes():
        assert index.match(probe) == ref.match(probe)


def _same_as_reference(ops: list[tuple], capacity: int | None) -> None:
    index, ref = MemoryPrefixIndex(), Reference()
    index.set_capacity("r0", capacity)
    ref.set_capacity("r0", capacity)
    for op in ops:
        _apply(index, ref, op)
        assert index.blocks("r0") == list(ref.lru["r0"]), op
        for probe in _probes():
            assert index.match(probe) == ref.match(probe), (op, probe)


def test_cuts_from_a_segments_head_middle_and_tail_keep_its_place_in_the_eviction_order() -> None:
    x, y, z = _A[:10], _E[:10], _D[3:8]
    for cut in (x[:3], x[4:6], x[7:], x[::2], list(reversed(x[2:9]))):
        ops = [("record", "r0", x, False), ("record", "r0", y, False), ("remove", "r0", cut, False)]
        ops += [("record", "r0", z, False), ("record", "r0", _C[:6], False)]
        _same_as_reference(ops, 20)


def test_re_touching_part_of_a_segment_splits_it_and_forks_continue_from_the_split() -> None:
    ops = [
        ("record", "r0", _C, False),
        ("record", "r0", _A[:15], False),  # ends inside the head _A, _B and _C share
        ("record", "r0", _B[5:30], False),  # starts inside a held segment (no block 0)
        ("record", "r0", _D, True),
        ("remove", "r0", _B[10:25], True),
        ("record", "r0", _A, False),
        ("record", "r0", _C[:22], False),
    ]
    for capacity in (None, 70, 45, 12):
        _same_as_reference(ops, capacity)


def test_a_growing_session_stays_a_few_segments() -> None:
    """Turn after turn, a session's prompt is its agent's head, its conversation and a new tail:
    the mirror keeps that as a handful of segments, so matching it does not grow with its length."""
    index = MemoryPrefixIndex()
    index.set_capacity("r", 100_000)
    head = chain("head", 300)
    others = [head + chain(f"other{i}", 50, head[-1]) for i in range(5)]
    convo = head + chain("mine", 100, head[-1])
    index.record("r", convo)
    for turn in range(30):
        for other in others:
            index.record("r", other)
        convo = convo + chain(f"turn{turn}", 60, convo[-1])
        assert index.match(convo[:-60]) == {"r": len(convo) - 60}
        index.record("r", convo)
    assert index.stats()["backends"]["r"]["segments"] <= 2 + len(others)
    assert index.match(convo) == {"r": len(convo)}
