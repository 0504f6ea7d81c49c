"""The vectorized ``MemoryPrefixIndex.match`` agrees with the block-by-block walk."""

from __future__ import annotations

import random

from routing.index.memory import MemoryPrefixIndex


def test_vectorized_match_equals_the_walk_on_random_mirrors() -> None:
    rng = random.Random(7)
    for _ in range(300):
        index = MemoryPrefixIndex()
        n = rng.randint(1, 400)
        chain = [rng.randbytes(16) for _ in range(n)]
        for b in range(rng.randint(1, 12)):
            name = f"b{b}"
            index.set_capacity(name, None)
            held = chain[: rng.randint(0, n)]
            if held:
                index.record(name, held)
            if rng.random() < 0.3:
                index.remove(name, [rng.choice(chain)])  # holes as well as prefixes
        expected = index.walk_match(chain)
        assert index.match(chain) == expected


def test_match_on_a_long_chain_reports_each_backends_prefix() -> None:
    index = MemoryPrefixIndex()
    chain = [i.to_bytes(8, "big") for i in range(5000)]
    for name, count in (("a", 5000), ("b", 1234), ("c", 0), ("d", 4999)):
        index.set_capacity(name, None)
        if count:
            index.record(name, chain[:count])
    assert index.match(chain) == {"a": 5000, "b": 1234, "d": 4999}
    assert index.match(chain[:100]) == {"a": 100, "b": 100, "d": 100}
