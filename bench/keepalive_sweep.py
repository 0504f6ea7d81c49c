"""Requests lost to keep-alive races: idle gaps swept around the ranks' 5 s keep-alive.

Simulated ranks run like vLLM's API server (uvicorn, idle connections closed after 5 s); prefixgate
runs in front of them in its own process, and agent-like sessions (an httpx client with its default
pool, like the openai SDK's) send turns of ``--prompt-kb`` separated by idle gaps swept from ``--low`` to
``--high`` seconds. A request is lost when it gets no answer (a transport error at the client, a
5xx); a session that changes rank between turns is counted apart (its cache is lost, not its
request). Also reported: latency p50/p99 and the ranks' hit rate over the run.

    python -m bench.keepalive_sweep [--sessions 100] [--turns 10] [--low 4.95] [--high 5.05]
        [--proxy-flag=--upstream-keepalive=30 ...]

Every gap is real time (nothing is replayed): the race depends on the wall clock, not on traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

from bench.common import Subprocess, free_port_run, machine, median, percentile, proxy_process, write_json

RULE = "You are a coding agent working in a large repository. Follow the rules below.\n"


def sweep_gaps(low: float, high: float, steps: int) -> list[float]:
    return [low + (high - low) * i / max(steps - 1, 1) for i in range(steps)]


#: ``gap_of(session, turn)``: the idle seconds after that turn.
GapOf = Callable[[int, int], float]


async def session(
    client: httpx.AsyncClient,
    index: int,
    turns: int,
    gap_of: GapOf,
    results: list[dict[str, Any]],
    prompt_kb: int,
    until: float | None = None,
) -> None:
    """One agent-like session: ``turns`` turns (or turns until the monotonic time ``until``), each
    re-sending the conversation, idle ``gap_of(index, turn)`` seconds between them."""
    await asyncio.sleep(index * 0.01)  # sessions spread over a second, as agents start
    # each session its own ~prompt_kb prompt: the proxy parses and hashes it all (a busy loop, as in
    # production, is what lets a rank's FIN wait unread while a request picks its connection)
    context = f"session {index}: " + RULE * (prompt_kb * 1024 // len(RULE))
    messages: list[dict[str, str]] = [{"role": "system", "content": context}]
    rank = None
    idle_before = 0.0  # the first turn opens its connection: no idle gap raced
    for turn in range(turns):
        messages.append({"role": "user", "content": f"session {index} turn {turn}: read the next file"})
        body = {"model": "prefixgate-sim", "messages": messages, "max_tokens": 8}
        gap = gap_of(index, turn)
        started = time.perf_counter()
        # a request is raced by the gap it follows, so that is the gap it is counted under
        outcome: dict[str, Any] = {"gap": idle_before, "turn": turn}
        try:
            response = await client.post(
                "/v1/chat/completions", json=body, headers={"x-session-id": f"s{index}"}
            )
        except httpx.TransportError as exc:
            outcome["lost"] = f"client {type(exc).__name__}"
        else:
            outcome["seconds"] = time.perf_counter() - started
            if response.status_code != 200:
                outcome["lost"] = f"HTTP {response.status_code} {error_code(response)}".rstrip()
            else:
                answer = response.json()
                usage = answer.get("usage") or {}
                outcome["prompt_tokens"] = usage.get("prompt_tokens", 0)
                outcome["cached_tokens"] = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                now = response.headers.get("x-prefixgate-backend")
                outcome["moved"] = rank is not None and now != rank
                rank = now
                messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        results.append(outcome)
        if turn + 1 == turns or (until is not None and time.monotonic() + gap >= until):
            return
        await asyncio.sleep(gap)
        idle_before = gap


def error_code(response: httpx.Response) -> str:
    """The error body's code (or type): which of prefixgate's refusals, or the rank's, it was."""
    try:
        error = response.json().get("error") or {}
    except (ValueError, AttributeError):
        return ""
    return str(error.get("code") or error.get("type") or "") if isinstance(error, dict) else ""


async def drive(
    url: str,
    sessions: int,
    turns: int,
    gap_of: GapOf,
    prompt_kb: int,
    pool_expiries: tuple[float, ...] = (5.0,),
    until: float | None = None,
) -> list[dict[str, Any]]:
    """``sessions`` sessions through prefixgate at ``url``; session i's client keeps idle connections
    ``pool_expiries[i % n]`` seconds (httpx's and the openai SDK's default: 5 s)."""
    results: list[dict[str, Any]] = []
    limits = [
        httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions, keepalive_expiry=expiry)
        for expiry in pool_expiries
    ]
    clients = [
        httpx.AsyncClient(base_url=url, timeout=60.0, limits=limit, trust_env=False) for limit in limits
    ]
    try:
        await asyncio.gather(
            *(
                session(clients[i % len(clients)], i, turns, gap_of, results, prompt_kb, until)
                for i in range(sessions)
            )
        )
    finally:
        for client in clients:
            await client.aclose()
    return results


#: prefixgate's counters read at the end of a run: what happened between it and the ranks.
UPSTREAM_COUNTERS = (
    "prefixgate_upstream_failures_total",
    "prefixgate_retries_total",
    "prefixgate_upstream_reconnects_total",
)


def upstream_counters(url: str) -> dict[str, Any]:
    """Each of ``UPSTREAM_COUNTERS`` summed over its labels (0 when prefixgate does not have it), and
    the failures by reason."""
    text = httpx.get(url + "/metrics", timeout=10).text
    totals: dict[str, Any] = dict.fromkeys(UPSTREAM_COUNTERS, 0.0)
    reasons: Counter[str] = Counter()
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in UPSTREAM_COUNTERS:
            value = float(line.rsplit(" ", 1)[1])
            totals[name] += value
            if name == UPSTREAM_COUNTERS[0] and 'reason="' in line:
                reasons[line.split('reason="', 1)[1].split('"', 1)[0]] += int(value)
    totals["failures_by_reason"] = dict(reasons)
    return totals


def summarize(results: list[dict[str, Any]]) -> dict[str, Any]:
    total = len(results)
    lost = Counter(r["lost"] for r in results if "lost" in r)
    moved = sum(1 for r in results if r.get("moved"))
    seconds = [r["seconds"] for r in results if "seconds" in r and "lost" not in r]
    prompt = sum(r.get("prompt_tokens", 0) for r in results)
    cached = sum(r.get("cached_tokens", 0) for r in results)
    by_gap: dict[str, dict[str, int]] = {}
    for r in results:
        row = by_gap.setdefault(f"{r['gap']:.3f}", {"requests": 0, "lost": 0, "moved": 0})
        row["requests"] += 1
        row["lost"] += "lost" in r
        row["moved"] += bool(r.get("moved"))
    return {
        "requests": total,
        "lost": sum(lost.values()),
        "lost_per_1000": 1000 * sum(lost.values()) / total if total else 0.0,
        "lost_by_kind": dict(lost),
        "moved": moved,
        "moved_per_1000": 1000 * moved / total if total else 0.0,
        "latency_p50_s": median(seconds),
        "latency_p99_s": percentile(seconds, 99),
        "hit_rate": cached / prompt if prompt else None,
        "by_gap": by_gap,
    }


def add_fleet_options(parser: argparse.ArgumentParser) -> None:
    """The options of the ranks and prefixgate a run goes through (shared with ``bench.soak``)."""
    parser.add_argument("--prompt-kb", type=int, default=100, help="size of each session's prompt")
    parser.add_argument(
        "--rank-kv-tokens",
        type=int,
        default=4_000_000,
        help="each simulated rank's KV pool: large, so that admission admits every session (the run "
        "is about connections, not capacity)",
    )
    parser.add_argument(
        "--rank-keep-alive", type=float, default=5.0, help="the ranks' keep-alive (uvicorn's)"
    )
    parser.add_argument(
        "--proxy-flag", action="append", default=[], help="an extra `prefixgate serve` flag (repeatable)"
    )
    parser.add_argument("--label", default="prefixgate", help="name of this run in the output")


def through_fleet(
    args: argparse.Namespace, run: Callable[[str], list[dict[str, Any]]]
) -> tuple[list[dict[str, Any]], dict[str, Any], float]:
    """Two simulated ranks and prefixgate in their own processes; ``run(url)``'s results, prefixgate's
    upstream counters after it, and its seconds."""
    base = free_port_run(2)
    # a process per rank, as vLLM's ranks are, each with uvicorn's keep-alive
    sim_args = [sys.executable, "-m", "proxy.cli", "sim", "--ranks", "1", "--time-scale", "0.001"]
    sim_args += ["--keep-alive", str(args.rank_keep_alive), "--kv-tokens", str(args.rank_kv_tokens)]
    ranks = [
        Subprocess([*sim_args, "--base-port", str(base + i)], f"http://127.0.0.1:{base + i}/health")
        for i in range(2)
    ]
    specs = [f"sim-{i}=http://127.0.0.1:{base + i}" for i in range(2)]
    # a simulated rank answers /health from the loop that also hashes every prompt; vLLM's API server
    # answers it apart from the engine. On a loaded machine the sim's answer can take seconds, and a
    # rank marked down for it would count here as a lost request that has nothing to do with keep-alive.
    health = ["--health-timeout", "10"]
    proxy, url = proxy_process(specs, extra=health + proxy_flags(args))
    with ranks[0], ranks[1], proxy:
        started = time.perf_counter()
        results = run(url)
        elapsed = time.perf_counter() - started
        counters = upstream_counters(url)
    return results, counters, elapsed


def proxy_flags(args: argparse.Namespace) -> list[str]:
    return [flag for value in args.proxy_flag for flag in shlex.split(value)]


def outcome_line(summary: dict[str, Any], counters: dict[str, Any]) -> str:
    """Lost and moved requests, latency, hit rate and prefixgate's upstream counters, on one line."""
    return (
        f"lost {summary['lost']} ({summary['lost_per_1000']:.1f} per 1,000: {summary['lost_by_kind']}), "
        f"moved {summary['moved']} ({summary['moved_per_1000']:.1f} per 1,000), "
        f"latency p50 {summary['latency_p50_s'] * 1e3:.0f} ms p99 {summary['latency_p99_s'] * 1e3:.0f} ms, "
        f"hit rate {summary['hit_rate'] or 0:.3f}; upstream failures "
        f"{counters['prefixgate_upstream_failures_total']:.0f} {counters['failures_by_reason']}, "
        f"retries on another rank {counters['prefixgate_retries_total']:.0f}, fresh-connection resends "
        f"{counters['prefixgate_upstream_reconnects_total']:.0f}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--low", type=float, default=4.95, help="shortest idle gap, seconds")
    parser.add_argument("--high", type=float, default=5.05, help="longest idle gap, seconds")
    parser.add_argument("--steps", type=int, default=21, help="gaps between --low and --high")
    add_fleet_options(parser)
    args = parser.parse_args(argv)
    gaps = sweep_gaps(args.low, args.high, args.steps)

    def gap_of(index: int, turn: int) -> float:
        return gaps[(index + turn) % len(gaps)]

    def run(url: str) -> list[dict[str, Any]]:
        return asyncio.run(drive(url, args.sessions, args.turns, gap_of, args.prompt_kb))

    results, counters, elapsed = through_fleet(args, run)
    summary = summarize(results)
    report = {
        "benchmark": "keepalive_sweep",
        "label": args.label,
        "machine": machine(),
        "sessions": args.sessions,
        "turns": args.turns,
        "gaps_s": gaps,
        "rank_keep_alive_s": args.rank_keep_alive,
        "prompt_kb": args.prompt_kb,
        "proxy_flags": proxy_flags(args),
        "seconds": elapsed,
        "upstream": counters,
        **summary,
    }
    path = write_json(f"keepalive_sweep_{args.label}.json", report)
    print(
        f"{args.label}: {summary['requests']} requests over gaps {args.low:.3f}-{args.high:.3f} s: "
        f"{outcome_line(summary, counters)} -> {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
