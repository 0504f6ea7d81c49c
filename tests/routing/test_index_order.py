"""The memory index's recency order against a plain reference model (vLLM's free-queue semantics).

Reference: one list per backend, least recently used first; ``record`` moves each block of the
chain to the end, tail first (so the head is newest); past capacity the front goes first.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.index.memory import MemoryPrefixIndex
from tests.routing.conftest import chain

CHAINS = {tag: chain(tag, 12) for tag in "abcdef"}
# A chain that shares a's first 5 blocks: prefixes are shared between sessions of one agent.
CHAINS["a2"] = CHAINS["a"][:5] + chain("a2", 7, CHAINS["a"][4])


class Reference:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: dict[str, list[bytes]] = {}

    def record(self, backend: str, hashes: list[bytes]) -> None:
        order = self.order.setdefault(backend, [])
        for h in reversed(hashes):
            if h in order:
                order.remove(h)
            order.append(h)
        del order[: max(len(order) - self.capacity, 0)]

    def remove(self, backend: str, hashes: list[bytes]) -> None:
        order = self.order.setdefault(backend, [])
        for h in hashes:
            if h in order:
                order.remove(h)

    def match(self, hashes: list[bytes]) -> dict[str, int]:
        out = {}
        for backend, order in self.order.items():
            held = set(order)
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            if n:
                out[backend] = n
        return out


OPS = st.lists(
    st.tuples(
        st.sampled_from(["record", "record", "record", "remove"]),
        st.sampled_from(["r0", "r1"]),
        st.sampled_from(sorted(CHAINS)),
        st.integers(1, 12),  # prefix length
        st.integers(0, 11),  # first removed block
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(OPS, st.integers(4, 30))
def test_order_eviction_and_matches_equal_the_reference(ops: list, capacity: int) -> None:
    index = MemoryPrefixIndex()
    ref = Reference(capacity)
    for backend in ("r0", "r1"):
        index.set_capacity(backend, capacity)
        ref.order[backend] = []
    for op, backend, tag, length, start in ops:
        hashes = CHAINS[tag][:length]
        if op == "record":
            index.record(backend, hashes)
            ref.record(backend, hashes)
        else:
            index.remove(backend, hashes[start:])
            ref.remove(backend, hashes[start:])
        for b in ("r0", "r1"):
            assert index.blocks(b) == ref.order[b], "least recently used first, chain tails before heads"
        for probe in CHAINS.values():
            assert index.match(probe) == ref.match(probe)


def test_touching_a_chain_again_protects_it_from_eviction() -> None:
    index = MemoryPrefixIndex()
    index.set_capacity("r", 24)
    a, b = chain("a", 12), chain("b", 12)
    index.record("r", a)
    index.record("r", b)
    index.record("r", a)  # a session re-sent: a is now the most recent
    index.record("r", chain("c", 4))
    assert index.match(a) == {"r": 12}
    assert index.match(b) == {"r": 8}, "the least recent chain loses its 4 tail blocks"
