"""Admission benchmark: Claude Code traces through 4 simulated ranks, admission on vs off.

Three runs of the same ``../shared/traces/claude-code`` conversations (``bench.replay.replay_trace``:
``--concurrency`` conversations at a time, think times x ``--think-scale``), each with prefixgate
(``prefixgate serve``, default policy) in front of 4 simulated ranks (``prefixgate sim``), each in
its own process:

1. under capacity: pools large enough that the working set stays well inside them (admission on);
2. over capacity, admission off (``--no-admission``): pools sized so the replay's mean working set
   (measured in run 1) is ``--pressure`` (1.5) x the fleet's pool;
3. over capacity, admission on (same pools), sessions counted until they idle out;
4. the same, with each conversation ended (``DELETE /admin/sessions/{id}``) after its last answer,
   as a harness that knows when its agent is done can do.

Reported per run, from the ranks' own usage: hit rate, prefill tokens computed, p50/p99 time to
first token (queueing for admission included), completed conversations per hour (wall clock of the
scaled replay), 429s. Targets (issue 7): admission on within 5 points of run 1's hit rate, and more
completed conversations per hour than admission off.

    python bench/admission.py [--conversations 25] [--requests 8] [--concurrency 24]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.common import Subprocess, free_port, free_port_run, machine, write_json  # noqa: E402
from bench.replay import ReplayResult, TraceReplayConfig, TurnResult, replay_trace  # noqa: E402
from bench.traces import TraceSession, load_claude_code  # noqa: E402

RANKS = 4
MODEL = "sim-model"


def _sim(base_port: int, kv_tokens: int, time_scale: float) -> Subprocess:
    args = [
        sys.executable,
        "-m",
        "proxy.cli",
        "sim",
        "--ranks",
        str(RANKS),
        "--base-port",
        str(base_port),
        "--kv-tokens",
        str(kv_tokens),
        "--time-scale",
        str(time_scale),
        "--model",
        MODEL,
    ]
    return Subprocess(args, f"http://127.0.0.1:{base_port + RANKS - 1}/health")


def _proxy(
    port: int, base_port: int, admission: bool, idle_ttl: float | None, wait: float | None
) -> Subprocess:
    args = [sys.executable, "-m", "proxy.cli", "serve", "--port", str(port), "--log-level", "warning"]
    for i in range(RANKS):
        args += ["--backend", f"sim-{i}=http://127.0.0.1:{base_port + i}"]
    # unset: prefixgate learns both clocks from the replay's traffic
    if idle_ttl is not None:
        args += ["--session-idle-ttl", str(idle_ttl)]
    if wait is not None:
        args += ["--admission-wait", str(wait)]
    if not admission:
        args.append("--no-admission")
    return Subprocess(args, f"http://127.0.0.1:{port}/health")


def _last_request(sessions: list[TraceSession]) -> dict[str, int]:
    """Session key -> index of its last request, for sessions that end with a request of their own."""
    return {
        s.key: len(s.requests) - 1
        for top in sessions
        for s in top.all_sessions()
        if s.requests and not s.children.get(len(s.requests))
    }


async def _replay(
    url: str, sessions: list[TraceSession], config: TraceReplayConfig, end_sessions: bool
) -> ReplayResult:
    """``replay_trace``; with ``end_sessions`` each session is ended (DELETE) after its last answer."""
    if not end_sessions:
        return await replay_trace(url, sessions, config)
    last = _last_request(sessions)
    ends: list[asyncio.Task[None]] = []
    async with httpx.AsyncClient(timeout=10) as http:

        async def end(key: str) -> None:
            await http.delete(f"{url}/admin/sessions/{key}")

        def on_turn(turn: TurnResult) -> None:
            if last.get(turn.session) == turn.turn:
                ends.append(asyncio.create_task(end(turn.session)))

        result = await replay_trace(url, sessions, config, on_turn)
        await asyncio.gather(*ends)
    return result


def run_one(
    label: str,
    sessions: list[TraceSession],
    args: argparse.Namespace,
    kv_tokens: int,
    admission: bool,
    end_sessions: bool = False,
) -> tuple[dict[str, Any], ReplayResult]:
    base = free_port_run(RANKS)
    port = free_port()
    # the trace's clock runs think_scale x faster
    idle_ttl = args.idle_ttl * args.think_scale if args.idle_ttl is not None else None
    with _sim(base, kv_tokens, args.time_scale), _proxy(port, base, admission, idle_ttl, args.wait):
        config = TraceReplayConfig(MODEL, concurrency=args.concurrency, time_scale=args.think_scale)
        result = asyncio.run(_replay(f"http://127.0.0.1:{port}", sessions, config, end_sessions))
    summary = result.summary()
    hours = result.wall_s / 3600
    refused = sum(1 for e in result.errors if "HTTP 429" in e)
    row = {
        "run": label,
        "admission": admission,
        "explicit_end": end_sessions,
        "kv_tokens_per_rank": kv_tokens,
        "fleet_pool_tokens": kv_tokens * RANKS,
        "mean_working_set": statistics.fmean(result.working_set) if result.working_set else 0.0,
        "hit_rate": summary["hit_rate"],
        "prefill_tokens": summary["prefill_tokens"],
        "prompt_tokens": summary["prompt_tokens"],
        "ttft_p50_ms": summary["ttft_p50_ms"],
        "ttft_p99_ms": summary["ttft_p99_ms"],
        "requests": summary["requests"],
        "errors": summary["errors"],
        "refused_429": refused,
        "error_samples": result.errors[:5],
        "completed_sessions": result.completed_sessions,
        "wall_s": result.wall_s,
        "completed_per_hour": result.completed_sessions / hours if hours else 0.0,
    }
    return row, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--conversations", type=int, default=25, help="Claude Code conversations replayed")
    parser.add_argument("--requests", type=int, default=8, help="first requests kept per conversation")
    parser.add_argument(
        "--max-prompt", type=int, default=80_000, help="skip conversations with longer prompts"
    )
    parser.add_argument("--concurrency", type=int, default=24, help="conversations in flight at once")
    parser.add_argument("--think-scale", type=float, default=0.01, help="trace think times x this")
    parser.add_argument("--time-scale", type=float, default=0.5, help="the sim's model time x this")
    parser.add_argument("--pressure", type=float, default=1.5, help="working set / fleet pool when over")
    parser.add_argument(
        "--idle-ttl", type=float, default=None, help="--session-idle-ttl in trace seconds (default: learned)"
    )
    parser.add_argument("--wait", type=float, default=None, help="--admission-wait (default: learned)")
    args = parser.parse_args(argv)

    sessions = load_claude_code(
        max_prompt_tokens=args.max_prompt, limit=args.conversations, max_requests=args.requests
    )
    print(
        f"{len(sessions)} Claude Code conversations (first {args.requests} requests, prompts <= "
        f"{args.max_prompt:,} tokens), {args.concurrency} at a time, {RANKS} simulated ranks",
        flush=True,
    )
    big = 4 * args.max_prompt * args.concurrency // RANKS
    rows = []
    under, _ = run_one("under capacity", sessions, args, big, admission=True)
    rows.append(under)
    print(f"  under capacity done: mean working set {under['mean_working_set']:,.0f} tokens", flush=True)
    # a rank must hold the largest single prompt, whatever the pressure asked for
    largest = max(s.max_input_tokens for top in sessions for s in top.all_sessions())
    per_rank = max(int(under["mean_working_set"] / (args.pressure * RANKS)), int(largest * 1.05))
    pressure = under["mean_working_set"] / (per_rank * RANKS)
    print(f"  over capacity: {per_rank:,} tokens per rank, working set {pressure:.2f}x the fleet pool")
    under["working_set_over_pool"] = under["mean_working_set"] / under["fleet_pool_tokens"]
    runs = (
        ("over capacity, admission off", False, False),
        ("over capacity, admission on", True, False),
        ("over cap., on + explicit end", True, True),
    )
    for label, on, end in runs:
        row, _ = run_one(label, sessions, args, per_rank, admission=on, end_sessions=end)
        row["working_set_over_pool"] = pressure
        rows.append(row)
        print(f"  {label} done", flush=True)

    header = (
        f"{'run':32} {'pool/rank':>10} {'hit rate':>9} {'prefill tok':>12} {'TTFT p50':>9} "
        f"{'TTFT p99':>9} {'done':>5} {'done/h':>8} {'429':>4}"
    )
    print(header)
    for r in rows:
        print(
            f"{r['run']:32} {r['kv_tokens_per_rank']:>10,} {r['hit_rate']:>9.1%} {r['prefill_tokens']:>12,} "
            f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms {r['completed_sessions']:>5} "
            f"{r['completed_per_hour']:>8.0f} {r['refused_429']:>4}"
        )
    off = rows[1]
    verdict = {}
    for on_row in rows[2:]:
        gap = (under["hit_rate"] - on_row["hit_rate"]) * 100
        verdict[on_row["run"]] = {
            "hit_rate_gap_points": gap,
            "within_5_points": gap <= 5,
            "more_completed_per_hour_than_off": on_row["completed_per_hour"] > off["completed_per_hour"],
        }
        print(
            f"{on_row['run']}: {gap:.1f} points below under capacity; "
            f"completed/h {on_row['completed_per_hour']:.0f} vs off {off['completed_per_hour']:.0f}"
        )
    path = write_json(
        "admission.json",
        {"config": vars(args), "machine": machine(), "runs": rows, "verdict": verdict},
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
