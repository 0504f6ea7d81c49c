"""One system of a comparison on a fresh simulated fleet: replay the trace, then read what was used.

Everything measured comes from what the ranks report (their ``usage`` per request and their
``/metrics`` counters) and, for the proxy's CPU time, from the OS; ``summarize`` adds the
infinite-cache bound of the requests as sent and the working set against the pools.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.replay import ReplayResult, TraceReplayConfig, TurnResult, bound_hit_rate, replay_trace
from bench.traces import TraceSession

if TYPE_CHECKING:  # psutil (the ``bench`` extra) is imported only when a benchmark runs
    from bench.systems import FleetConfig, SystemSpec


def run_system(
    spec: SystemSpec,
    sessions: list[TraceSession],
    fleet_config: FleetConfig,
    replay_config: TraceReplayConfig,
    out: Path,
    on_turn: Callable[[TurnResult], None],
    prefixgate_args: Sequence[str] = (),
    prefixgate_root: Path | None = None,
) -> dict[str, Any]:
    """One system on a fresh fleet: replay, then read the ranks' counters and the proxy's CPU."""
    from bench.systems import ProcessCpu, SimFleetProcess, system_under_test

    started = time.perf_counter()
    logs = out / "logs"
    with SimFleetProcess(fleet_config, log=logs / "sim.log") as fleet:
        with system_under_test(spec, fleet.urls, logs, prefixgate_args, prefixgate_root) as running:
            cpu = ProcessCpu(running.pid)
            cpu.start()
            result = asyncio.run(replay_trace(running.url, sessions, replay_config, on_turn))
            cpu.stop()
        counters = fleet.metrics()
    return summarize(result, counters, cpu.seconds, fleet_config, time.perf_counter() - started)


def summarize(
    result: ReplayResult, counters: dict[str, float], cpu_s: float | None, fleet: FleetConfig, run_s: float
) -> dict[str, Any]:
    """The replay's summary with the bound, the fleet's counters, the proxy's CPU and every turn."""
    summary = result.summary()
    queries = counters["vllm:prefix_cache_queries"]
    pool = fleet.ranks * fleet.kv_tokens
    summary.update(
        {
            "bound": bound_hit_rate(result),
            "completed_sessions": result.completed_sessions,
            "rank_prefix_cache_hit_rate": counters["vllm:prefix_cache_hits"] / queries if queries else 0.0,
            "preemptions": int(counters["vllm:num_preemptions"]),
            "rank_counters": counters,
            "proxy_cpu_s": cpu_s,
            "proxy_cpu_ms_per_request": cpu_s * 1000 / len(result.turns) if cpu_s and result.turns else None,
            "working_set_mean_x_pools": (
                sum(result.working_set) / len(result.working_set) / pool if result.working_set else 0.0
            ),
            "working_set_peak_x_pools": max(result.working_set, default=0) / pool,
            "run_s": run_s,
            "first_errors": result.errors[:3],
            "turns": [turn.as_json() for turn in result.turns],
        }
    )
    return summary
