"""``prefixgate bench``'s dimensions: the ranks' compute speed beside memory pressure (pools sized from
the replay's working set), prefixgate at its defaults with settings side by side on request, and the
verdict against the peers and the issue's targets."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from bench.bench_cmd import configure_parser, select_systems
from bench.bench_presets import PRESSURES, SPEEDS, prefill_rate, resolve, scenario_fleet
from bench.bench_run import late_seats
from bench.pressure import mean_working_set, pool_for
from bench.traces import TraceRequest, TraceSession
from bench.verdict import PREFIXGATE, verdict, verdict_lines


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(list(argv))


def conversation(key: str, prompts: list[int], think_s: float = 10.0) -> TraceSession:
    requests = [TraceRequest((), tokens, 8, think_time_s=think_s) for tokens in prompts]
    return TraceSession(key=key, requests=requests)


def test_the_working_set_is_what_the_schedule_keeps_active() -> None:
    # two conversations at once, 10 s think times x 0.1: a and b overlap, c runs after a
    sessions = [conversation("a", [100, 200]), conversation("b", [1000, 1000, 1000]), conversation("c", [50])]
    both = mean_working_set(sessions, concurrency=2, time_scale=0.1)
    alone = mean_working_set(sessions, concurrency=1, time_scale=0.1)
    assert alone < both
    assert pool_for(both, 2.0, ranks=2, block_size=16) * 2 * 2 >= both  # 2x the fleet's pools
    assert pool_for(10.0, 1.0, ranks=1) >= 4096  # never below a workable pool


def test_presets_run_every_speed_and_pressure() -> None:
    preset = resolve(parse("--preset", "matrix"))
    assert preset.speeds == ("fast", "slow") and preset.scenarios == ("fits", "over", "heavy")
    assert prefill_rate("fast") == SPEEDS["fast"] == 20_000 and 2_000 <= prefill_rate("slow") <= 3_000
    assert prefill_rate("7000") == 7000.0
    sessions = [conversation(f"s{i}", [10_000 * (1 + i % 3)] * 4) for i in range(30)]
    pools = {s: scenario_fleet(preset, s, sessions, 16)[1] for s in preset.scenarios}
    assert pools["fits"] > pools["over"] > pools["heavy"]
    assert pools["over"] / pools["heavy"] == pytest.approx(PRESSURES["heavy"] / PRESSURES["over"], rel=0.01)
    with pytest.raises(SystemExit):
        resolve(parse("--preset", "matrix", "--speeds", "warp"))


def test_prefixgate_runs_at_its_defaults_with_other_settings_beside_it_on_request() -> None:
    systems, _ = select_systems(parse("--no-peers", "--systems", "prefixgate:prefix_affinity"))
    assert [(s.name, s.args) for s in systems] == [(PREFIXGATE, ())]
    clocks = "prefixgate:prefix_affinity:--session-idle-ttl 1.5 --admission-wait 0.5"
    scaled, _ = select_systems(parse("--no-peers", "--systems", clocks))
    assert scaled[0].args == ("--session-idle-ttl", "1.5", "--admission-wait", "0.5")
    flags, _ = select_systems(parse("--no-peers", "--systems", "prefixgate:prefix_affinity:--no-admission"))
    assert flags[0].policy == "prefix_affinity" and flags[0].args == ("--no-admission",)


def result(hit: float, p99: float, wall: float, errors: int = 0, pressure: float = 1.3) -> dict:
    return {
        "hit_rate": hit,
        "prefill_tokens": int((1 - hit) * 1e6),
        "ttft_p50_ms": p99 / 10,
        "ttft_p99_ms": p99,
        "latency_mean_ms": p99 / 5,
        "wall_s": wall,
        "rejections": 0,
        "errors": errors,
        "bound": 0.95,
        "working_set_mean_x_pools": pressure,
    }


def test_the_verdict_reads_each_target_against_the_best_peer() -> None:
    results = {
        PREFIXGATE: result(0.90, 1200.0, 80.0),
        "vllm-router consistent_hash": result(0.72, 1000.0, 82.0),
        "sglang cache_aware": result(0.70, 900.0, 90.0),
    }
    found = verdict("fast-over", results)
    assert found is not None and not found["fits"]
    targets = found["targets"]
    assert targets["hit rate"]["met"]  # 0.90 >= 0.72 + 0.15
    assert not targets["TTFT p99"]["met"]  # 1,200 > 1.25 x 900
    assert targets["completion"]["met"] and targets["errors"]["met"]
    assert found["ahead"]["hit rate"]["ahead"] and not found["ahead"]["TTFT p99"]["ahead"]
    lines = verdict_lines(found)
    assert "MISSED" in lines[-2] and lines[0].startswith(PREFIXGATE)
    fits = verdict("slow-fits", {**results, PREFIXGATE: result(0.945, 800.0, 70.0, pressure=0.5)})
    assert fits is not None and fits["fits"] and fits["targets"]["hit rate"]["met"]  # within 0.01 of 0.95
    assert verdict("over", {PREFIXGATE: result(0.9, 1.0, 1.0)}) is None  # no peer ran
    assert "seat wait p99" not in targets  # a build that does not count its late seats


def test_the_seat_wait_target_allows_one_request_in_a_hundred_past_the_bound() -> None:
    peer = result(0.72, 1000.0, 82.0)
    for late, met in ((0, True), (2, True), (3, False)):
        ours = {**result(0.90, 1200.0, 80.0), "requests": 200, "seat_waits_past_bound": late}
        found = verdict("fast-over", {PREFIXGATE: ours, "vllm-router consistent_hash": peer})
        assert found is not None and found["targets"]["seat wait p99"]["met"] is met, late


def test_rounds_default_to_one_and_must_be_positive() -> None:
    assert parse().rounds == 1
    assert parse("--rounds", "3").rounds == 3
    with pytest.raises(SystemExit):
        parse("--rounds", "0")


def test_the_bench_reads_the_late_seats_by_reason() -> None:
    registry = CollectorRegistry()
    late = Counter("prefixgate_admission_waits_past_bound", "late", ("reason",), registry=registry)
    late.labels("busy").inc(3)
    late.labels("short").inc(2)
    assert late_seats(generate_latest(registry).decode()) == {"busy": 3, "short": 2}
    assert late_seats("# TYPE other counter\nother_total 1.0\n") is None  # an older build
