"""Hit accounting, eviction order and preemption, on the engine and pool directly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.sim.block_pool import BlockPool, BlockRemoved, BlockStored
from bench.sim.scheduler import Engine

from .conftest import drain, make_engine, prompt_of, run_one

A = list(range(64))
B = [1000 if i == 17 else i for i in range(64)]


@pytest.mark.parametrize(
    ("first", "second", "hit"),
    [
        (A, A, 48),  # fully cached 64 tokens: the last token is recomputed, so its block is not a hit
        (list(range(65)), list(range(65)), 64),  # one token past the boundary: all 4 blocks hit
        (A, list(range(40)), 32),  # partial block: floor(39/16) = 2 blocks
        (A, B, 16),  # changed token in block 1 breaks the chain from block 1 on
        (A, list(range(16)), 0),  # a single block prompt can never hit (last-token rule)
        (list(range(10)), list(range(10)), 0),  # no full block at all
        (list(range(32)), A, 32),  # longer prompt over a shorter cached one
    ],
)
def test_hit_tokens_hand_computed(first: list[int], second: list[int], hit: int) -> None:
    engine = make_engine()
    assert run_one(engine, first).num_cached_tokens == 0
    assert run_one(engine, second).num_cached_tokens == hit
    c = engine.counters
    assert c.prefix_cache_hits == hit
    assert c.prefix_cache_queries == len(first) + len(second)


def test_cache_salt_and_prompt_logprobs() -> None:
    engine = make_engine()
    run_one(engine, A, salt="s3cr3t")
    assert run_one(engine, A).num_cached_tokens == 0  # no salt: other chain
    assert run_one(engine, A, salt="other").num_cached_tokens == 0
    assert run_one(engine, A, salt="s3cr3t").num_cached_tokens == 48
    # prompt_logprobs disables reads and the lookup is not counted
    queries = engine.counters.prefix_cache_queries
    assert run_one(engine, A, skip_prefix_cache=True).num_cached_tokens == 0
    assert engine.counters.prefix_cache_queries == queries


def test_hashes_equal_shared_vectors(shared_dir: Path) -> None:
    vectors = json.loads((shared_dir / "specs" / "vllm_hash_vectors.json").read_text())
    case = vectors["cases"]["v0.33.0/sha256/PYTHONHASHSEED=0"]
    engine = make_engine()
    seqs = {
        "A_tokens_0_63": (A, None),
        "B_tokens_0_63_with_idx17_changed_to_1000": (B, None),
        "C_tokens_0_39": (list(range(40)), None),
        "D_tokens_0_63_cache_salt_s3cr3t": (A, "s3cr3t"),
    }
    for key, (tokens, salt) in seqs.items():
        req = run_one(engine, tokens, salt=salt)
        prompt_hashes = req.block_hashes[: len(tokens) // 16]
        assert [h.hex() for h in prompt_hashes] == case["sequences"][key]


def test_decode_blocks_are_cached_as_they_fill() -> None:
    engine = make_engine()
    prompt = list(range(100, 120))  # 20 tokens
    req = run_one(engine, prompt, max_tokens=30)
    assert len(req.output_token_ids) == 30
    # 20 prompt + 29 computed outputs = 49 tokens -> 3 full blocks cached
    follow_up = [*req.all_token_ids, 7, 8, 9]
    assert run_one(engine, follow_up).num_cached_tokens == 48


def test_eviction_order_tail_first_and_lru_across_requests() -> None:
    engine = make_engine(num_blocks=9, events=True)  # 8 usable blocks
    pool = engine.pool
    pool.record_events = True
    x = run_one(engine, list(range(48)))  # blocks 1,2,3
    assert pool.free_queue_ids() == [4, 5, 6, 7, 8, 3, 2, 1]  # freed tail first, after never-used ones
    run_one(engine, list(range(1000, 1048)))  # Y takes 4,5,6
    assert pool.free_queue_ids() == [7, 8, 3, 2, 1, 6, 5, 4]
    pool.take_events()
    run_one(engine, list(range(2000, 2064)))  # needs 4 blocks: 7, 8, then X's tail (3) and middle (2)
    removed = [e.block_hashes[0] for e in pool.take_events() if isinstance(e, BlockRemoved)]
    assert removed == [x.block_hashes[2], x.block_hashes[1]]
    assert pool.free_queue_ids() == [1, 6, 5, 4, 2, 3, 8, 7]
    # Y is intact (2 blocks hit: last-token rule); its one new block evicts the LRU head: X's first block
    assert run_one(engine, list(range(1000, 1048))).num_cached_tokens == 32
    assert run_one(engine, list(range(48))).num_cached_tokens == 0


def test_duplicate_blocks_are_not_deduplicated() -> None:
    engine = make_engine()
    prompt = prompt_of(engine, list(range(48)))
    (first,), _ = engine.submit(prompt, 1)
    (second,), _ = engine.submit(prompt, 1)
    plan = engine.schedule()  # both admitted in one step: the second hits blocks 0-1 of the first
    assert [n for _, n in plan.scheduled] == [48, 16]  # and recomputes block 2 (last-token rule)
    assert second.num_cached_tokens == 32
    copies = engine.pool.cached[prompt.block_hashes[2]]
    assert len(copies) == 2  # two blocks hold the same hash: no de-duplication
    assert first.blocks[:2] == second.blocks[:2] and first.blocks[2] is not second.blocks[2]
    engine.pool.check_invariants()
    drain(engine)
    assert len(engine.pool.cached[prompt.block_hashes[2]]) == 2  # both stay cached once freed


def test_preemption_newest_first_under_pressure() -> None:
    engine = make_engine(num_blocks=9)  # 8 usable blocks of 16 tokens
    p1 = prompt_of(engine, list(range(40)))
    p2 = prompt_of(engine, list(range(500, 540)))
    (a,), _ = engine.submit(p1, 60)  # each grows to ceil(99/16) = 7 blocks: both cannot fit
    (b,), _ = engine.submit(p2, 60)
    drain(engine)
    assert len(a.output_token_ids) == 60 and len(b.output_token_ids) == 60
    assert a.num_preemptions == 0
    assert b.num_preemptions >= 1  # the newest running request is the victim
    c = engine.counters
    assert c.num_preemptions == b.num_preemptions
    # the resumed lookups are kept apart from the ones clients see
    assert c.preempted_queries > 0
    assert c.prefix_cache_queries == 80
    assert c.prefix_cache_hits == a.num_cached_tokens + b.num_cached_tokens == 0


def test_pool_rejects_over_allocation_and_reset_needs_idle_pool() -> None:
    pool = BlockPool(4, 16, record_events=True)
    blocks = pool.get_new_blocks(3)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    assert not pool.reset_prefix_cache()
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache()
    pool.check_invariants()


def test_block_stored_event_carries_chain_and_tokens() -> None:
    engine: Engine = make_engine(events=True)
    pool = engine.pool
    pool.record_events = True
    run_one(engine, list(range(40)))
    stored = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    assert len(stored) == 1
    assert stored[0].parent_block_hash is None
    assert stored[0].token_ids == list(range(32))
    run_one(engine, list(range(72)))  # hits 2 blocks, stores blocks 2..3 with block 1 as parent
    stored = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash == engine.hasher.hash_blocks(list(range(32)))[1]
    assert stored[0].token_ids == list(range(32, 64))


def test_requests_queue_beyond_max_num_seqs_and_step_time_grows_with_batch() -> None:
    engine = make_engine(max_num_seqs=2)
    for i in range(3):
        engine.submit(prompt_of(engine, list(range(i * 100, i * 100 + 20))), 4)
    plan = engine.schedule()
    assert len(engine.running) == 2 and len(engine.waiting) == 1
    assert plan.prefill_tokens == 40 and plan.decode_seqs == 0
    engine.update(plan)
    decode = engine.schedule()
    assert decode.decode_seqs == 2 and decode.prefill_tokens == 0
    cfg = engine.config
    assert engine.step_time(decode) > cfg.decode_base_s + cfg.decode_per_seq_s  # grows with the batch
    engine.update(decode)
    drain(engine)
    assert engine.counters.requests_finished == 3
