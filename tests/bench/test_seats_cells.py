"""Issue 45's benchmark cells: output lengths from the trace, the seed fleet, the two traffic shapes,
and the columns computed from a replay's turns."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import dataclass

import aiohttp
import httpx
import pytest

from bench.bench_cmd import configure_parser
from bench.bench_presets import preset_cells, resolve
from bench.bench_tables import markdown_table, new_cells, retried
from bench.cells import FLEETS, plan_cell, shaped
from bench.chat_stream import Rejected, post_chat_stream, post_with_retries
from bench.pressure import mean_working_set
from bench.replay import TraceReplayConfig, output_tokens, replay_trace
from bench.sim import Engine, Prompt, SimConfig
from bench.systems import FleetConfig, SimFleetProcess
from bench.traces import TraceRequest, TraceSession
from bench.turn_figures import turn_figures
from tests.helpers.ranks import RankServers
from tests.helpers.wait import wait_until_async


def _session(key: str, turns: int, outs: list[int] | None = None, tokens: int = 1024) -> TraceSession:
    """A conversation of ``turns`` requests, each ``tokens`` longer than the one before."""
    per = tokens // 64
    requests = []
    blocks: tuple[tuple[str, int], ...] = ()
    for turn in range(turns):
        blocks = blocks + tuple((key, turn * per + j) for j in range(per))
        out = outs[turn] if outs else 10
        requests.append(TraceRequest(blocks, len(blocks) * 64, out, think_time_s=1.0))
    return TraceSession(key=key, requests=requests)


# -- output lengths ----------------------------------------------------------------------------------


def test_a_request_asks_the_trace_output_length_capped() -> None:
    capped = TraceReplayConfig(model="m", max_tokens=8, max_output_tokens=512)
    fixed = TraceReplayConfig(model="m", max_tokens=8)
    assert output_tokens(TraceRequest((), 64, 2_000), capped) == 512
    assert output_tokens(TraceRequest((), 64, 300), capped) == 300
    assert output_tokens(TraceRequest((), 64, 0), capped) == 1  # a rank answers at least one token
    assert output_tokens(TraceRequest((), 64, 2_000), fixed) == 8  # older presets: the fixed length


def test_the_rank_generates_the_capped_trace_lengths_and_the_next_turns_still_hit(
    rank_servers: RankServers,
) -> None:
    (rank,) = rank_servers.sim(1, kv_tokens=1_000_000)
    session = _session("a", 3, outs=[3, 40, 7])
    config = TraceReplayConfig(model="prefixgate-sim", time_scale=0, max_output_tokens=20)
    result = asyncio.run(asyncio.wait_for(replay_trace(rank.url, [session], config), 60))
    assert result.errors == []
    assert [t.completion_tokens for t in result.turns] == [3, 20, 7]
    assert result.summary()["generated_tokens"] == 30
    # the answers the rank generated do not replace the trace's: each turn still extends the last
    for turn in result.turns:
        assert turn.cached_tokens == turn.bound_hit_tokens
    assert result.turns[2].cached_tokens > 0


# -- the seed fleet ----------------------------------------------------------------------------------


def test_the_seed_fleet_is_one_rank_of_8_seats_and_256_token_blocks() -> None:
    plan = plan_cell("seed", "sessions", 1.25, [_session(f"s{i}", 4) for i in range(12)], **_PRESET)
    assert (plan.ranks, plan.kv_tokens, plan.block_size, plan.max_num_seqs) == (1, 181_777, 256, 8)
    config = FleetConfig(
        ranks=plan.ranks,
        kv_tokens=plan.kv_tokens,
        time_scale=0,
        block_size=plan.block_size,
        max_num_seqs=plan.max_num_seqs,
    )
    with SimFleetProcess(config) as fleet:
        (url,) = fleet.urls
        state = httpx.get(url + "/sim/state", timeout=5).json()
        info = httpx.get(url + "/server_info", timeout=5).json()
    assert state["block_size"] == 256 and state["num_blocks"] == 181_777 // 256
    assert info["max_running_requests"] == 8


def test_a_rank_of_8_seats_runs_at_most_8_sequences_at_once() -> None:
    async def schedule() -> tuple[int, int]:
        engine = Engine(SimConfig(max_num_seqs=8, block_size=256, time_scale=0))
        for i in range(10):
            tokens = [i + 1] * 300
            engine.submit(Prompt(tokens, engine.hasher.hash_blocks(tokens)), 4)
        engine.schedule()
        return len(engine.running), len(engine.waiting)

    assert asyncio.run(schedule()) == (8, 2)


# -- the traffic shapes ------------------------------------------------------------------------------

_PRESET = {"ranks": 2, "concurrency": 3, "session_turns": 5, "time_scale": 0.01}


def test_the_sessions_shape_caps_turns_and_starts_them_together() -> None:
    candidates = [_session(f"s{i}", 8) for i in range(6)]
    candidates[0].start_s = 30.0  # a trace's own start time does not delay a session here
    sessions, concurrency = shaped("sessions", candidates, 4, 5)
    assert [s.key for s in sessions] == ["s0", "s1", "s2", "s3"]
    assert concurrency == 4  # every one of them runs at once
    assert all(len(s.requests) == 5 and s.start_s == 0.0 for s in sessions)
    assert all(len(s.requests) == 8 for s in candidates)  # the trace is left whole
    assert sessions[0].requests == candidates[0].requests[:5]


def test_the_whole_shape_queues_as_many_whole_conversations_again() -> None:
    candidates = [_session(f"s{i}", 8) for i in range(10)]
    sessions, concurrency = shaped("whole", candidates, 3, 5)
    assert concurrency == 3 and [s.key for s in sessions] == [f"s{i}" for i in range(6)]
    assert all(len(s.requests) == 8 for s in sessions)


def test_the_whole_shape_takes_only_conversations_short_enough_and_keeps_them_whole() -> None:
    candidates = [_session(f"s{i}", turns) for i, turns in enumerate([30, 5, 25, 10, 24, 8, 40, 3])]
    plan = plan_cell("several", "whole", 1.25, candidates, **_PRESET, whole_turns=24)
    assert [s.key for s in plan.sessions] == ["s1", "s3", "s4", "s5", "s7"]
    assert [len(s.requests) for s in plan.sessions] == [5, 10, 24, 8, 3]
    assert plan.concurrency == 3


def test_on_the_seed_fleet_pressure_is_how_many_sessions_run_at_once() -> None:
    candidates = [_session(f"s{i}", 4, tokens=10_240) for i in range(30)]
    counts = {}
    for pressure in (0.5, 1.25, 1.9):
        plan = plan_cell("seed", "sessions", pressure, candidates, **_PRESET)
        assert plan.kv_tokens == FLEETS["seed"].kv_tokens  # the pool stays the seed's
        working_set = mean_working_set(plan.sessions, plan.concurrency, _PRESET["time_scale"])
        assert plan.pressure_planned == pytest.approx(working_set / 181_777)
        # no other count of sessions comes closer to the pressure aimed at
        for other in (plan.concurrency - 1, plan.concurrency + 1):
            others = shaped("sessions", candidates, other, 5)
            other_pressure = mean_working_set(*others, _PRESET["time_scale"]) / 181_777
            assert abs(plan.pressure_planned - pressure) <= abs(other_pressure - pressure)
        counts[pressure] = plan.concurrency
    assert counts[0.5] < counts[1.25] < counts[1.9]


def test_on_several_ranks_pressure_is_the_pools_size() -> None:
    candidates = [_session(f"s{i}", 4, tokens=10_240) for i in range(10)]
    fits = plan_cell("several", "sessions", 0.5, candidates, **_PRESET)
    heavy = plan_cell("several", "sessions", 1.9, candidates, **_PRESET)
    assert fits.concurrency == heavy.concurrency == 3 and fits.ranks == 2
    assert fits.kv_tokens > heavy.kv_tokens
    assert heavy.pressure_planned == pytest.approx(1.9, rel=0.01)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(list(argv))


def test_the_seats_preset_runs_every_cell_and_flags_pick_a_subset() -> None:
    candidates = [_session(f"s{i}", 6, tokens=10_240) for i in range(40)]
    every = preset_cells(resolve(_args("--preset", "seats")), candidates)
    assert len(every) == 2 * 2 * 2 * 3
    assert every[0].name == "seed-whole-fast-fits" and every[-1].name == "several-sessions-slow-heavy"
    picked = resolve(
        _args(
            "--preset",
            "seats",
            "--fleet",
            "seed",
            "--shapes",
            "sessions",
            "--speeds",
            "slow",
            "--scenarios",
            "over",
        )
    )
    (cell,) = preset_cells(picked, candidates)
    assert cell.name == "seed-sessions-slow-over" and cell.max_num_seqs == 8 and cell.prefill_rate == 2_500
    assert picked.max_output_tokens == 512
    assert resolve(_args("--preset", "seats", "--max-output-tokens", "0")).max_output_tokens is None
    with pytest.raises(SystemExit):
        resolve(_args("--preset", "seats", "--fleet", "three"))


def test_older_presets_keep_their_scenarios_and_fixed_output() -> None:
    preset = resolve(_args("--preset", "matrix"))
    candidates = [_session(f"s{i}", 6, tokens=10_240) for i in range(40)]
    names = [cell.name for cell in preset_cells(preset, candidates)]
    assert names == [f"{s}-{p}" for s in ("fast", "slow") for p in ("fits", "over", "heavy")]
    assert preset.max_output_tokens is None and preset.max_tokens == 8


# -- the new columns ---------------------------------------------------------------------------------


@dataclass
class _Turn:
    turn: int
    ttft_s: float
    completion_tokens: int
    held_s: float | None
    rank_queue_s: float | None


def test_the_turn_figures_from_known_turns() -> None:
    turns = [
        _Turn(0, 1.0, 100, 0.5, 0.1),
        _Turn(0, 3.0, 100, 2.0, 0.3),
        _Turn(1, 0.2, 200, 0.0, 0.0),
        _Turn(2, 0.4, 100, None, None),  # a rank that did not tell its times
    ]
    figures = turn_figures(turns, wall_s=10.0)
    assert figures["generated_tokens"] == 500
    assert figures["generated_tok_s"] == pytest.approx(50.0)
    assert figures["ttft_first_p50_ms"] == pytest.approx(2000.0)
    assert figures["ttft_first_p99_ms"] == pytest.approx(3000.0)
    assert figures["ttft_returning_p50_ms"] == pytest.approx(300.0)
    assert figures["ttft_returning_p99_ms"] == pytest.approx(400.0)
    assert figures["seat_wait_p99_ms"] == pytest.approx(2000.0)
    assert figures["rank_queue_p99_ms"] == pytest.approx(300.0)
    assert turn_figures([], wall_s=0.0)["seat_wait_p99_ms"] is None


def _summary(**figures: object) -> dict[str, object]:
    summary: dict[str, object] = {
        "hit_rate": 0.9,
        "bound": 0.95,
        "prefill_tokens": 1_000_000,
        "preemptions": 0,
        "ttft_p50_ms": 10.0,
        "ttft_p99_ms": 90.0,
        "latency_p50_ms": 20.0,
        "latency_p99_ms": 200.0,
        "latency_mean_ms": 30.0,
        "wall_s": 12.0,
        "completed_sessions": 4,
        "errors": 0,
        "rejections": 5,
        "rate_limited": 3,
        "proxy_cpu_ms_per_request": 1.0,
    }
    summary.update(figures)
    return summary


def test_the_tables_show_the_new_columns() -> None:
    r = _summary(
        generated_tok_s=1839.4,
        ttft_first_p50_ms=700.0,
        ttft_first_p99_ms=935.0,
        ttft_returning_p50_ms=12.0,
        ttft_returning_p99_ms=134.0,
        seat_wait_p99_ms=590.0,
        rank_queue_p99_ms=108.0,
    )
    assert new_cells(r, "ms") == ["1839", "700/935ms", "12/134ms", "590ms", "108ms"]
    assert retried(r) == "3 +2"  # three 429s, two other answers retried
    table = markdown_table({"prefixgate": r, "old": _summary()})
    header, _, row, old = table.splitlines()
    assert header.count("|") == row.count("|") == old.count("|")
    assert "| 1839 | 700/935 ms | 12/134 ms | 590 ms | 108 ms | 12.0 s |" in row
    assert "| - | -/- ms | -/- ms | - ms | - ms |" in old  # a summary from before the columns


# -- seat wait and 429s ------------------------------------------------------------------------------


def test_a_rank_reporting_its_timing_gives_when_it_received_and_scheduled(rank_servers: RankServers) -> None:
    (rank,) = rank_servers.sim(1, report_timing=True)
    body = {
        "model": "prefixgate-sim",
        "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def post() -> tuple[float, float | None, float | None]:
        import time

        sent = time.time()
        async with aiohttp.ClientSession() as http:
            out = await post_chat_stream(http, rank.url, body, "s")
        return sent, out.arrived_at, out.scheduled_at

    sent, arrived, scheduled = asyncio.run(post())
    assert arrived is not None and scheduled is not None
    assert sent <= arrived <= scheduled


def test_each_429_is_counted_and_retried(rank_servers: RankServers) -> None:
    (rank,) = rank_servers.stub(1, status=429)
    statuses: list[int] = []
    body = {"model": "stub-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}

    def heard(rejected: Rejected) -> None:
        statuses.append(rejected.status)

    async def post() -> int:
        async with aiohttp.ClientSession() as http:
            sent = asyncio.ensure_future(post_with_retries(http, rank.url, body, "s", 50, 0.05, heard))
            await wait_until_async(lambda: len(rank.behavior.received) >= 2, timeout=20.0)
            rank.behavior.status = None
            _, rejections = await asyncio.wait_for(sent, 30)
        return rejections

    rejections = asyncio.run(post())
    assert rejections >= 2 and statuses == [429] * rejections
