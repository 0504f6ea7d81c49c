"""A rank's CPU tier size, learned from its KV events: the tier is full at its first eviction, and
its size is what it held just before (the largest seen is kept)."""

from __future__ import annotations

from bench.sim.config import SimConfig
from bench.sim.kv_events import encode_batch
from bench.sim.scheduler import Engine
from routing.index import CPU, GPU
from routing.index.memory import MemoryPrefixIndex
from routing.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, RankMirror, decode_batch
from tests.sim.conftest import VECTOR_SEED, prompt_of
from tokenization.block_hash import BlockHasher

BLOCK = 16


def mirror_of() -> tuple[RankMirror, MemoryPrefixIndex, list[tuple[str, int]]]:
    index = MemoryPrefixIndex()
    told: list[tuple[str, int]] = []
    hasher = BlockHasher(BLOCK, "sha256", seed=VECTOR_SEED)
    mirror = RankMirror("r", index, hasher, on_tier_full=lambda medium, tokens: told.append((medium, tokens)))
    return mirror, index, told


def stored_gpu(first: int, n: int, parent: int | None = None) -> BlockStored:
    """``n`` blocks stored on the GPU, rank hashes ``first ..``, each of its own tokens."""
    tokens = [first * 1000 + i for i in range(n * BLOCK)]
    return BlockStored(list(range(first, first + n)), parent, tokens, BLOCK, medium=GPU)


def test_a_cpu_eviction_teaches_the_tier_size_and_a_demotion_does_not() -> None:
    mirror, index, told = mirror_of()
    mirror.apply([stored_gpu(1, 6)])
    # vLLM's offloading connector copies blocks to CPU by hash alone; the GPU then drops them
    mirror.apply([BlockStored([1, 2, 3, 4], medium=CPU)])
    mirror.apply([BlockRemoved([3, 4], medium=GPU)])  # demotions: still held in CPU
    assert mirror.tier_blocks[CPU] == 4 and index.held_by_tier("r") == (4, 2)
    assert told == [] and mirror.tier_full_blocks == {}
    # a removal of a CPU copy the mirror never saw announced is nothing the tier did
    mirror.apply([BlockRemoved([5, 99], medium=CPU)])
    assert told == []

    # the tier evicts to make room (vLLM: evictions first, then the stores they made room for)
    mirror.apply([BlockRemoved([3], medium=CPU), BlockStored([5], medium=CPU)])
    assert told == [(CPU, 4 * BLOCK)] and mirror.tier_full_blocks == {CPU: 4}
    assert mirror.tier_blocks[CPU] == 4
    # evicting again at the same fill teaches nothing new
    mirror.apply([BlockRemoved([1, 2], medium=CPU), BlockStored([6], medium=CPU)])
    assert told == [(CPU, 4 * BLOCK)] and mirror.tier_blocks[CPU] == 3
    # a cleared tier, or a restarted rank, empties the fill but the size learned stays
    mirror.apply([AllBlocksCleared(medium=CPU)])
    assert mirror.tier_blocks[CPU] == 0 and mirror.tier_full_blocks == {CPU: 4}
    mirror.apply([stored_gpu(10, 6), BlockStored(list(range(10, 16)), medium=CPU)])
    mirror.apply([BlockRemoved([10], medium=CPU)])  # a larger tier than thought: it grows
    assert told == [(CPU, 4 * BLOCK), (CPU, 6 * BLOCK)]
    mirror.reset()
    assert not mirror.tier_blocks and mirror.tier_full_blocks == {CPU: 6}


def test_the_simulators_events_teach_its_tier_size_at_its_first_eviction() -> None:
    capacity = 20
    cfg = SimConfig(
        num_blocks=24,
        block_size=BLOCK,
        hash_seed=VECTOR_SEED,
        time_scale=0,
        cpu_tier_tokens=capacity * BLOCK,
        cpu_load_rate=1000.0,
        prefill_rate=10_000.0,
    )
    engine = Engine(cfg, lambda ts, events: None)  # events recorded; taken after each step
    mirror, _, told = mirror_of()
    assert engine.cpu_tier is not None
    for tag in range(12):
        tokens = [tag * 1000 + i for i in range((4 + tag % 3) * BLOCK)]
        engine.submit(prompt_of(engine, tokens), 1)
        while engine.running or engine.waiting:
            plan = engine.schedule()
            engine.update(plan)
            events = engine.pool.take_events()
            mirror.apply(decode_batch(encode_batch(0.0, events, 0, "0.33"))[1])
            assert mirror.unmapped == 0
            if engine.cpu_tier.evicted == 0:
                assert told == [], "nothing is learned before the tier evicts"
            assert mirror.tier_blocks[CPU] == len(engine.cpu_tier)
    assert engine.cpu_tier.evicted > 0, "the prompts overflowed the pool and the tier"
    # at most a block over: the simulator stores a block before it evicts for it
    assert told and told[0][1] in (capacity * BLOCK, (capacity + 1) * BLOCK)
    assert mirror.tier_full_blocks[CPU] in (capacity, capacity + 1)
