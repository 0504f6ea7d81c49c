"""A hung Redis under traffic: throughput and latency through prefixgate while Redis answers, then
while it is stopped (SIGSTOP: its connections stay open, nothing answers), side by side.

prefixgate (its own process, ``--redis-url``) before two simulated ranks; ``--clients`` agent-like
sessions send chat turns in a closed loop for ``--seconds`` per phase while a probe times
``GET /health`` every 0.2 s. Reported per phase: requests per second, latency p50/p99, errors, the
ranks' hit rate, and ``/health`` p50/max.

    python -m bench.redis_stall [--clients 16] [--seconds 10]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from typing import Any

import httpx

from bench.common import Subprocess, free_port_run, machine, median, percentile, proxy_process, write_json
from proxy.state.embedded_redis import EmbeddedRedis

SYSTEM = "You are a coding agent. Read files, run tests, edit code carefully.\n" * 200


async def phase(url: str, clients: int, seconds: float, tag: str) -> dict[str, Any]:
    latencies: list[float] = []
    health: list[float] = []
    errors = 0
    prompt = cached = 0
    deadline = time.monotonic() + seconds

    async def session(client: httpx.AsyncClient, index: int) -> None:
        nonlocal errors, prompt, cached
        messages = [{"role": "system", "content": SYSTEM}]
        turn = 0
        while time.monotonic() < deadline:
            messages.append({"role": "user", "content": f"{tag} session {index} turn {turn}: next step"})
            started = time.perf_counter()
            try:
                response = await client.post(
                    "/v1/chat/completions",
                    json={"model": "prefixgate-sim", "messages": messages, "max_tokens": 4},
                    headers={"x-session-id": f"{tag}-{index}"},
                )
            except httpx.HTTPError:
                errors += 1
                continue
            if response.status_code != 200:
                errors += 1
                continue
            latencies.append(time.perf_counter() - started)
            answer = response.json()
            usage = answer.get("usage") or {}
            prompt += usage.get("prompt_tokens", 0)
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
            turn += 1

    async def probe(client: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            started = time.perf_counter()
            try:
                await client.get("/health")
                health.append(time.perf_counter() - started)
            except httpx.HTTPError:
                health.append(float("inf"))
            await asyncio.sleep(0.2)

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits, trust_env=False) as client:
        started = time.perf_counter()
        await asyncio.gather(probe(client), *(session(client, i) for i in range(clients)))
        elapsed = time.perf_counter() - started
    return {
        "requests": len(latencies),
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": median(latencies) * 1e3,
        "p99_ms": percentile(latencies, 99) * 1e3,
        "errors": errors,
        "hit_rate": cached / prompt if prompt else None,
        "health_p50_ms": median(health) * 1e3,
        "health_max_ms": max(health) * 1e3 if health else float("nan"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--label", default="prefixgate")
    args = parser.parse_args(argv)
    redis = EmbeddedRedis().start()  # its own process, which SIGSTOP can hang
    assert redis.proc is not None
    base = free_port_run(2)
    sim = [
        sys.executable,
        "-m",
        "proxy.cli",
        "sim",
        "--ranks",
        "2",
        "--base-port",
        str(base),
        "--time-scale",
        "0.001",
    ]
    specs = [f"sim-{i}=http://127.0.0.1:{base + i}" for i in range(2)]
    proxy, url = proxy_process(specs, extra=["--redis-url", redis.url])
    report: dict[str, Any] = {"benchmark": "redis_stall", "label": args.label, "machine": machine()}
    try:
        time.sleep(0.3)
        with Subprocess(sim, f"http://127.0.0.1:{base}/health"), proxy:
            report["redis_up"] = asyncio.run(phase(url, args.clients, args.seconds, "up"))
            os.kill(redis.proc.pid, signal.SIGSTOP)
            try:
                report["redis_stopped"] = asyncio.run(phase(url, args.clients, args.seconds, "stopped"))
            finally:
                os.kill(redis.proc.pid, signal.SIGCONT)
    finally:
        redis.stop()
    path = write_json(f"redis_stall_{args.label}.json", report)
    for name in ("redis_up", "redis_stopped"):
        p = report[name]
        print(
            f"{args.label} {name}: {p['requests_per_s']:.1f} req/s, p50 {p['p50_ms']:.0f} ms "
            f"p99 {p['p99_ms']:.0f} ms, errors {p['errors']}, hit rate {p['hit_rate'] or 0:.3f}, "
            f"/health p50 {p['health_p50_ms']:.1f} ms max {p['health_max_ms']:.0f} ms"
        )
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
