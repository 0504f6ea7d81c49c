"""One cell of ``prefixgate bench``: every system in turn on a fresh simulated fleet, with a progress bar.

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

from bench.common import metrics_text
from bench.replay import ReplayResult, TraceReplayConfig, TurnResult, bound_hit_rate, replay_trace
from bench.traces import TraceSession

if TYPE_CHECKING:  # psutil (the ``bench`` extra) is imported only when a benchmark runs
    from bench.systems import FleetConfig, SystemSpec


def run_cell(
    name: str,
    systems: Sequence[SystemSpec],
    sessions: list[TraceSession],
    fleet: FleetConfig,
    replay: TraceReplayConfig,
    n_requests: int,
    prefixgate_args: Sequence[str],
    out: Path,
) -> tuple[dict[str, dict[str, Any]], bool]:
    """Each system's summary (``{"failed": why}`` for one that did not finish), and whether any
    failed or had errors."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    results: dict[str, dict[str, Any]] = {}
    failed = False
    with Progress(
        TextColumn("{task.description:<48}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[hits]}"),
    ) as progress:
        for spec in systems:
            task = progress.add_task(f"{name}: {spec.name}", total=n_requests, hits="")
            tally = [0, 0]

            def on_turn(turn: TurnResult, task: Any = task, tally: list[int] = tally) -> None:
                tally[0] += turn.prompt_tokens
                tally[1] += turn.cached_tokens
                hits = f"hit rate {tally[1] / tally[0]:.3f}" if tally[0] else ""
                progress.update(task, advance=1, hits=hits)

            try:
                results[spec.name] = run_system(spec, sessions, fleet, replay, out, on_turn, prefixgate_args)
            except Exception as exc:  # one system failing must not lose the others' results
                results[spec.name] = {"failed": f"{type(exc).__name__}: {exc}"}
                failed = True
            if results[spec.name].get("errors"):
                failed = True
            progress.update(task, total=progress.tasks[task].completed)  # stop its clock
    return results, failed


def write_cell_plots(name: str, results: dict[str, dict[str, Any]], out: Path) -> None:
    done = {n: r for n, r in results.items() if "failed" not in r}
    if not done:
        return
    from bench.plots import write_plots

    bound = next(iter(done.values()))["bound"]
    paths = write_plots(name, done, bound, out)
    print("plots: " + ", ".join(str(p) for p in paths))


def run_system(
    spec: SystemSpec,
    sessions: list[TraceSession],
    fleet_config: FleetConfig,
    replay_config: TraceReplayConfig,
    out: Path,
    on_turn: Callable[[TurnResult], None],
    prefixgate_args: Sequence[str] = (),
) -> dict[str, Any]:
    """One system on a fresh fleet: replay, then read the ranks' counters and the proxy's CPU."""
    from bench.systems import ProcessCpu, SimFleetProcess, system_under_test

    started = time.perf_counter()
    logs = out / "logs"
    with SimFleetProcess(fleet_config, log=logs / "sim.log") as fleet:
        with system_under_test(spec, fleet.urls, logs, prefixgate_args) as running:
            cpu = ProcessCpu(running.pid)
            cpu.start()
            result = asyncio.run(replay_trace(running.url, sessions, replay_config, on_turn))
            cpu.stop()
            text = metrics_text(running.url) if spec.kind == "prefixgate" else None
        counters = fleet.metrics()
    summary = summarize(result, counters, cpu.seconds, fleet_config, time.perf_counter() - started)
    late = late_seats(text) if text is not None else None
    summary["session_moves"] = moves_in(text) if text is not None else None
    summary["seat_waits_past_bound"] = sum(late.values()) if late is not None else None
    summary["seat_waits_past_bound_by_reason"] = late
    return summary


def counter_by_label(text: str, family: str, label: str) -> dict[str, float] | None:
    """Counter ``family`` of a ``/metrics`` text, its ``_total`` per value of ``label``; None from a
    build without it."""
    from prometheus_client.parser import text_string_to_metric_families

    for found in text_string_to_metric_families(text):
        if found.name == family:
            return {s.labels[label]: s.value for s in found.samples if s.name.endswith("_total")}
    return None


def late_seats(text: str) -> dict[str, int] | None:
    """The sessions prefixgate seated after waiting past its rotation bound and one poll interval,
    by why no seat came sooner (``prefixgate_admission_waits_past_bound_total{reason}``), from a
    ``/metrics`` text; None from a build without the metric."""
    late = counter_by_label(text, "prefixgate_admission_waits_past_bound", "reason")
    return {reason: int(n) for reason, n in late.items()} if late is not None else None


def session_moves(url: str) -> dict[str, float] | None:
    """prefixgate's count of known sessions routed off their rank, by what that rank held of the
    prompt (``prefixgate_session_moves_total{held}``); None from a build without the metric."""
    return moves_in(metrics_text(url))


def moves_in(text: str) -> dict[str, float] | None:
    """``session_moves`` from a ``/metrics`` text."""
    moves = counter_by_label(text, "prefixgate_session_moves", "held")
    return {**dict.fromkeys(("gpu", "cpu", "none"), 0.0), **moves} if moves is not None else None


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
