"""Helpers for the simulated-rank tests: engines driven step by step, servers on free ports."""

from __future__ import annotations

import pytest

from bench.sim import SimConfig, SimRankServer
from bench.sim.prompts import Prompt
from bench.sim.scheduler import Engine
from bench.sim.sequences import SimRequest
from tests.helpers.ranks import RankServers

VECTOR_SEED = "0"  # the PYTHONHASHSEED of shared/specs/vllm_hash_vectors.json


def make_engine(num_blocks: int = 64, events: bool = False, **kw: object) -> Engine:
    cfg = SimConfig(num_blocks=num_blocks, block_size=16, hash_seed=VECTOR_SEED, time_scale=0, **kw)  # type: ignore[arg-type]
    sink: list[object] = []
    return Engine(cfg, (lambda ts, ev: sink.extend(ev)) if events else None)


def prompt_of(engine: Engine, tokens: list[int], salt: str | None = None) -> Prompt:
    return Prompt(tokens, engine.hasher.hash_blocks(tokens, cache_salt=salt))


def drain(engine: Engine, max_steps: int = 10_000) -> int:
    """Run steps (no sleeping) until nothing is queued; checks the pool invariants after every step."""
    steps = 0
    while engine.running or engine.waiting:
        plan = engine.schedule()
        engine.pool.check_invariants()
        assert plan.scheduled, "engine stalled"
        engine.update(plan)
        engine.pool.check_invariants()
        steps += 1
        assert steps < max_steps
    return steps


def run_one(
    engine: Engine, tokens: list[int], max_tokens: int = 1, salt: str | None = None, **kw: object
) -> SimRequest:
    reqs, _ = engine.submit(prompt_of(engine, tokens, salt), max_tokens, cache_salt=salt, **kw)  # type: ignore[arg-type]
    drain(engine)
    return reqs[0]


@pytest.fixture
def sim(rank_servers: RankServers) -> SimRankServer:
    (server,) = rank_servers.sim(1, num_blocks=512, hash_seed=VECTOR_SEED)
    return server
