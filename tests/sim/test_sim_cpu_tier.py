"""The simulator's CPU tier (KV offloading): blocks evicted from the GPU pool wait in CPU memory,
a prompt that hits them loads them back instead of prefilling, and the events mirror both tiers."""

from __future__ import annotations

import pytest

from bench.sim.block_pool import AllBlocksCleared, BlockRemoved, BlockStored, PoolEvent
from bench.sim.config import SimConfig
from bench.sim.kv_events import encode_batch
from bench.sim.scheduler import Engine
from routing.index.memory import MemoryPrefixIndex
from routing.kv_events import RankMirror, decode_batch
from tokenization.block_hash import BlockHasher

from .conftest import VECTOR_SEED, drain, prompt_of

BLOCK = 16


def make_tier_engine(
    num_blocks: int = 17, cpu_blocks: int = 64, load_rate: float = 1000.0
) -> tuple[Engine, list[PoolEvent]]:
    cfg = SimConfig(
        num_blocks=num_blocks,
        block_size=BLOCK,
        hash_seed=VECTOR_SEED,
        time_scale=0,
        cpu_tier_tokens=cpu_blocks * BLOCK,
        cpu_load_rate=load_rate,
        prefill_rate=10_000.0,
    )
    engine = Engine(cfg, lambda ts, ev: None)  # events recorded; step_all takes them
    # a new list: an engine of an earlier test, collected, may have had the same id
    events: list[PoolEvent] = []
    SINKS[id(engine)] = events
    return engine, events


#: engine id -> the events its steps recorded, in order
SINKS: dict[int, list[PoolEvent]] = {}


def tokens_of(tag: int, n_blocks: int) -> list[int]:
    return [tag * 1000 + i for i in range(n_blocks * BLOCK)]


def step_all(engine: Engine, tokens: list[int]) -> list[tuple[int, int, float]]:
    """Run one request to its end: per step (prefill tokens, loaded tokens, modelled seconds)."""
    reqs, _ = engine.submit(prompt_of(engine, tokens), 1)
    steps = []
    sink = SINKS.get(id(engine), [])
    while engine.running or engine.waiting:
        plan = engine.schedule()
        engine.pool.check_invariants()
        steps.append((plan.prefill_tokens, plan.loaded_tokens, engine.step_time(plan)))
        engine.update(plan)
        sink.extend(engine.pool.take_events())
    assert reqs[0].status.name == "FINISHED"
    return steps


def test_an_evicted_prompt_hits_the_cpu_tier_and_loads_instead_of_prefilling() -> None:
    engine, _ = make_tier_engine()
    first = [*tokens_of(1, 8), 7]  # 8 full blocks and one more token
    step_all(engine, first)
    for filler in (2, 3):  # 16 usable GPU blocks: the first prompt's are evicted
        step_all(engine, tokens_of(filler, 15))
    assert engine.pool.get_cached(prompt_of(engine, first).block_hashes[0]) is None
    assert engine.cpu_tier is not None and len(engine.cpu_tier) >= 8
    hits_before = engine.counters.prefix_cache_hits

    reqs, _ = engine.submit(prompt_of(engine, first), 1)
    plan = engine.schedule()
    assert plan.loaded_tokens == 8 * BLOCK, "the whole prefix loads from the CPU tier"
    assert plan.prefill_tokens == 1, "only the last token is computed"
    assert engine.step_time(plan) == pytest.approx(8 * BLOCK / 1000.0 + 1 / 10_000.0)
    engine.update(plan)
    drain(engine)
    assert reqs[0].num_cached_tokens == 8 * BLOCK, "reported in cached_tokens, as vLLM does"
    assert engine.counters.cpu_tier_hits == 8 * BLOCK
    assert engine.counters.prefix_cache_hits == hits_before, "no GPU hit"
    # loaded back onto the GPU: the next time it is a GPU hit, with nothing to load
    reqs, _ = engine.submit(prompt_of(engine, first), 1)
    plan = engine.schedule()
    assert (plan.loaded_tokens, plan.prefill_tokens) == (0, 1)
    engine.update(plan)
    drain(engine)
    assert reqs[0].num_cached_tokens == 8 * BLOCK


def test_without_a_tier_the_evicted_prompt_is_prefilled() -> None:
    cfg = SimConfig(num_blocks=17, block_size=BLOCK, hash_seed=VECTOR_SEED, time_scale=0)
    engine = Engine(cfg)
    first = [*tokens_of(1, 8), 7]
    step_all(engine, first)
    for filler in (2, 3):
        step_all(engine, tokens_of(filler, 15))
    steps = step_all(engine, first)
    assert sum(s[0] for s in steps) == len(first) and sum(s[1] for s in steps) == 0


def test_cpu_tier_is_lru_and_bounded() -> None:
    engine, events = make_tier_engine(cpu_blocks=10)
    for tag in range(1, 5):
        step_all(engine, [*tokens_of(tag, 8), 7])
    assert engine.cpu_tier is not None and len(engine.cpu_tier) == 10
    assert engine.cpu_tier.evicted > 0
    cpu_removed = [e for e in events if isinstance(e, BlockRemoved) and e.medium == "CPU"]
    assert len(cpu_removed) == engine.cpu_tier.evicted
    # no loads: the tier holds the ten blocks offloaded last, least recently offloaded first
    offloaded = [e.block_hashes[0] for e in events if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert len(offloaded) == 10 + engine.cpu_tier.evicted
    assert list(engine.cpu_tier) == offloaded[-10:]
    assert [e.block_hashes[0] for e in cpu_removed] == offloaded[:-10]


def test_events_order_an_offload_before_its_gpu_removal() -> None:
    engine, events = make_tier_engine()
    step_all(engine, [*tokens_of(1, 8), 7])
    events.clear()
    step_all(engine, tokens_of(2, 15))
    offloads = [i for i, e in enumerate(events) if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert offloads
    for i in offloads:
        stored = events[i]
        assert isinstance(stored, BlockStored) and stored.token_ids == [] and stored.parent_block_hash is None
        removal = next(e for e in events[i:] if isinstance(e, BlockRemoved) and e.medium == "GPU")
        assert removal.block_hashes == stored.block_hashes


@pytest.mark.parametrize("version", ["0.33", "0.11"])
def test_an_index_fed_by_the_events_agrees_with_the_pool_by_tier(version: str) -> None:
    """Many prompts through a small pool and tier: after every request, the mirror built from the
    encoded events holds exactly the pool's and the tier's blocks, each in its tiers."""
    engine, events = make_tier_engine(num_blocks=24, cpu_blocks=20)
    index = MemoryPrefixIndex()
    mirror = RankMirror("r", index, BlockHasher(BLOCK, "sha256", seed=VECTOR_SEED))
    prompts = [[*tokens_of(t, 3 + t % 5), t] for t in range(12)]
    order = [0, 1, 2, 0, 3, 4, 5, 1, 6, 7, 0, 8, 9, 10, 2, 11, 3, 0, 5, 9]
    demoted = loaded = 0
    for n, p in enumerate(order):
        before = engine.counters.cpu_tier_hits
        step_all(engine, prompts[p])
        loaded += engine.counters.cpu_tier_hits > before
        _, decoded, _ = decode_batch(encode_batch(float(n), events, 0, version))
        events.clear()
        mirror.apply(decoded)
        assert mirror.unmapped == 0
        held = index._mirror("r")
        held.check_tiers()
        gpu = set(engine.pool.cached)
        assert engine.cpu_tier is not None
        cpu = set(engine.cpu_tier)
        assert set(held.where) == gpu | cpu
        for h in gpu | cpu:
            assert held.on_gpu(h) == (h in gpu)
            assert (held.offloaded_copies(h) > 0) == (h in cpu)
            assert held.copies(h) == len(engine.pool.cached.get(h, {})) + (h in cpu)
        demoted += held.offloaded_only_count() > 0
        for q in prompts:  # lookups: what the mirror says a prompt would hit, by tier
            hashes = prompt_of(engine, q).block_hashes
            found = index.lookup(hashes, None)
            g = 0
            while g < len(hashes) and hashes[g] in gpu:
                g += 1
            total = g
            while total < len(hashes) and hashes[total] in gpu | cpu:
                total += 1
            assert found.matches.get("r", 0) == total
    assert demoted and loaded, "the run went through demotions and loads"
    engine.pool.reset_prefix_cache()
    events.extend(engine.pool.take_events())
    _, decoded, _ = decode_batch(encode_batch(99.0, events, 0, version))
    assert [type(e) for e in events] == [AllBlocksCleared]
    mirror.apply(decoded)
    assert index._mirror("r").size == 0 and engine.cpu_tier is not None and len(engine.cpu_tier) == 0
