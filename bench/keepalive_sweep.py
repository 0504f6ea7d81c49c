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
from typing import Any

import httpx

from bench.common import Subprocess, free_port_run, machine, median, percentile, proxy_process, write_json

RULE = "You are a coding agent working in a large repository. Follow the rules below.\n"


def sweep_gaps(low: float, high: float, steps: int) -> list[float]:
    return [low + (high - low) * i / max(steps - 1, 1) for i in range(steps)]


async def session(
    client: httpx.AsyncClient,
    index: int,
    turns: int,
    gaps: list[float],
    results: list[dict[str, Any]],
    prompt_kb: int,
) -> None:
    await asyncio.sleep(index * 0.01)  # sessions spread over a second, as agents start
    # each session its own ~prompt_kb prompt: the proxy parses and hashes it all (a busy loop, as in
    # production, is what lets a rank's FIN wait unread while a request picks its connection)
    context = f"session {index}: " + RULE * (prompt_kb * 1024 // len(RULE))
    messages: list[dict[str, str]] = [{"role": "system", "content": context}]
    rank = None
    for turn in range(turns):
        messages.append({"role": "user", "content": f"session {index} turn {turn}: read the next file"})
        body = {"model": "prefixgate-sim", "messages": messages, "max_tokens": 8}
        gap = gaps[(index + turn) % len(gaps)]
        started = time.perf_counter()
        outcome: dict[str, Any] = {"gap": gap, "turn": turn}
        try:
            response = await client.post(
                "/v1/chat/completions", json=body, headers={"x-session-id": f"s{index}"}
            )
        except httpx.TransportError as exc:
            outcome["lost"] = f"client {type(exc).__name__}"
        else:
            outcome["seconds"] = time.perf_counter() - started
            if response.status_code != 200:
                outcome["lost"] = f"HTTP {response.status_code}"
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
        if turn + 1 < turns:
            await asyncio.sleep(gap)


async def drive(
    url: str, sessions: int, turns: int, gaps: list[float], prompt_kb: int
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    # httpx's default pool (5 s keep-alive expiry), as the openai SDK uses it
    limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    async with httpx.AsyncClient(base_url=url, timeout=60.0, limits=limits, trust_env=False) as client:
        await asyncio.gather(*(session(client, i, turns, gaps, results, prompt_kb) for i in range(sessions)))
    return results


#: prefixgate's counters read at the end of a run: what happened between it and the ranks.
UPSTREAM_COUNTERS = (
    "prefixgate_upstream_failures_total",
    "prefixgate_retries_total",
    "prefixgate_upstream_reconnects_total",
)


def upstream_counters(url: str) -> dict[str, float]:
    """Each of ``UPSTREAM_COUNTERS`` summed over its labels (0 when prefixgate does not have it)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    totals = dict.fromkeys(UPSTREAM_COUNTERS, 0.0)
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=100)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--low", type=float, default=4.95, help="shortest idle gap, seconds")
    parser.add_argument("--high", type=float, default=5.05, help="longest idle gap, seconds")
    parser.add_argument("--steps", type=int, default=21, help="gaps between --low and --high")
    parser.add_argument("--prompt-kb", type=int, default=400, help="size of each session's prompt")
    parser.add_argument(
        "--rank-keep-alive", type=float, default=5.0, help="the ranks' keep-alive (uvicorn's)"
    )
    parser.add_argument(
        "--proxy-flag", action="append", default=[], help="an extra `prefixgate serve` flag (repeatable)"
    )
    parser.add_argument("--label", default="prefixgate", help="name of this run in the output")
    args = parser.parse_args(argv)

    base = free_port_run(2)
    sim_args = [sys.executable, "-m", "proxy.cli", "sim", "--ranks", "2", "--base-port", str(base)]
    sim_args += ["--time-scale", "0.001", "--keep-alive", str(args.rank_keep_alive)]
    specs = [f"sim-{i}=http://127.0.0.1:{base + i}" for i in range(2)]
    gaps = sweep_gaps(args.low, args.high, args.steps)
    ranks = Subprocess(sim_args, f"http://127.0.0.1:{base}/health")
    extra = [flag for value in args.proxy_flag for flag in shlex.split(value)]
    proxy, url = proxy_process(specs, extra=extra)
    with ranks, proxy:
        started = time.perf_counter()
        results = asyncio.run(drive(url, args.sessions, args.turns, gaps, args.prompt_kb))
        elapsed = time.perf_counter() - started
        counters = upstream_counters(url)
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
        "proxy_flags": extra,
        "seconds": elapsed,
        "upstream": counters,
        **summary,
    }
    path = write_json(f"keepalive_sweep_{args.label}.json", report)
    print(
        f"{args.label}: {summary['requests']} requests over gaps {args.low:.3f}-{args.high:.3f} s: "
        f"lost {summary['lost']} ({summary['lost_per_1000']:.1f} per 1,000: {summary['lost_by_kind']}), "
        f"moved {summary['moved']} ({summary['moved_per_1000']:.1f} per 1,000), "
        f"latency p50 {summary['latency_p50_s'] * 1e3:.0f} ms p99 {summary['latency_p99_s'] * 1e3:.0f} ms, "
        f"hit rate {summary['hit_rate'] or 0:.3f}; upstream failures "
        f"{counters['prefixgate_upstream_failures_total']:.0f}, retries on another rank "
        f"{counters['prefixgate_retries_total']:.0f}, fresh-connection resends "
        f"{counters['prefixgate_upstream_reconnects_total']:.0f} -> {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
