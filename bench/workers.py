"""Throughput of ``prefixgate serve --workers N``: requests/s at high concurrency with 100k-token prompts.

Fast stub ranks (own processes) stand in for vLLM. ``--concurrency`` sessions each loop on their own
~100k-token conversation (a returning agent's turn: the conversation re-sent with a small new
message), non-streaming, for ``--seconds`` after a warm-up, through:

- ``1 (memory)``: one process, state in memory (the single-process baseline);
- ``N workers``: ``serve --workers N`` (N processes sharing an embedded Redis) for each N given.

Prints per configuration requests/s, p50/p99 latency, errors, and Redis commands per request (from
the embedded server's own counters: every command prefixgate sent, an upper bound of its round
trips, which pipelining batches); writes ``bench/out/workers.json``. Client, ranks and proxies share
this machine's cores, so scaling is bounded by them: compare the configurations side by side.

    python -m bench.workers [--workers 2,4] [--concurrency 256] [--seconds 20] [--ranks 2]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from typing import Any

import aiohttp
import orjson
import psutil
import redis

from bench.common import (
    embedded_tokenizer_config,
    machine,
    median,
    percentile,
    proxy_process,
    stub_rank_process,
    write_json,
)
from bench.overhead import large_request

WARMUP_S = 5.0


async def _session(
    url: str, key: str, base: list[Any], until: float, warm_until: float, out: dict[str, Any]
) -> None:
    history = list(base)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as client:
        turn = 0
        while time.monotonic() < until:
            history.append({"role": "user", "content": f"{key} turn {turn}: next step"})
            body = orjson.dumps({"model": "stub-model", "messages": history, "max_tokens": 16})
            start = time.monotonic()
            try:
                async with client.post(
                    url + "/v1/chat/completions",
                    data=body,
                    headers={"content-type": "application/json", "x-session-id": key},
                ) as answer:
                    await answer.read()
                    ok = answer.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            end = time.monotonic()
            if start >= warm_until and end <= until:
                if ok:
                    out["latencies"].append(end - start)
                else:
                    out["errors"] += 1
            history.append({"role": "assistant", "content": "done."})
            turn += 1


async def _load(url: str, concurrency: int, seconds: float) -> dict[str, Any]:
    base = orjson.loads(large_request(stream=False))["messages"]
    warm_until = time.monotonic() + WARMUP_S
    until = warm_until + seconds
    out: dict[str, Any] = {"latencies": [], "errors": 0}
    await asyncio.gather(*(_session(url, f"s{i}", base, until, warm_until, out) for i in range(concurrency)))
    latencies = out["latencies"]
    return {
        "requests": len(latencies),
        "req_per_s": len(latencies) / seconds,
        "p50_s": median(latencies) if latencies else None,
        "p99_s": percentile(latencies, 99) if latencies else None,
        "errors": out["errors"],
    }


def _redis_commands(proc: psutil.Process) -> int | None:
    """Commands the embedded Redis (a child of the supervisor) processed, from its own INFO."""
    for child in proc.children(recursive=True):
        for conn in child.net_connections(kind="unix"):
            if conn.laddr and conn.laddr.endswith("redis.sock"):
                client = redis.Redis(unix_socket_path=conn.laddr)
                return int(client.info("stats")["total_commands_processed"])
    return None


def run(workers: int, ranks: list[str], concurrency: int, seconds: float) -> dict[str, Any]:
    config = embedded_tokenizer_config()
    extra = ["--config", str(config)] + (["--workers", str(workers)] if workers > 1 else [])
    proxy, url = proxy_process(ranks, extra=extra)
    try:
        with proxy:
            assert proxy.proc is not None
            supervisor = psutil.Process(proxy.proc.pid)
            before = _redis_commands(supervisor) if workers > 1 else None
            result = asyncio.run(_load(url, concurrency, seconds))
            after = _redis_commands(supervisor) if workers > 1 else None
    finally:
        config.unlink()
    if before is not None and after is not None and result["requests"]:
        result["redis_commands_per_request"] = (after - before) / result["requests"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4", help="worker counts to run beside one process")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--ranks", type=int, default=2, help="stub ranks (own processes)")
    args = parser.parse_args()
    stubs = [stub_rank_process() for _ in range(args.ranks)]
    for stub, _ in stubs:
        stub.__enter__()
    try:
        specs = [f"stub{i}={url}" for i, (_, url) in enumerate(stubs)]
        results: dict[str, Any] = {"1 (memory)": run(1, specs, args.concurrency, args.seconds)}
        for n in (int(w) for w in args.workers.split(",") if w):
            results[f"{n} workers"] = run(n, specs, args.concurrency, args.seconds)
    finally:
        for stub, _ in stubs:
            stub.__exit__(None, None, None)
    base = results["1 (memory)"]["req_per_s"] or 1.0
    header = f"{'configuration':<14}{'req/s':>9}{'x one':>8}{'p50 s':>9}{'p99 s':>9}{'errors':>8}"
    print(header + f"{'redis cmd/req':>15}")
    for name, r in results.items():
        cmds = r.get("redis_commands_per_request")
        print(
            f"{name:<14}{r['req_per_s']:>9.1f}{r['req_per_s'] / base:>8.2f}"
            f"{(r['p50_s'] or 0):>9.3f}{(r['p99_s'] or 0):>9.3f}{r['errors']:>8}"
            f"{'' if cmds is None else f'{cmds:.1f}':>15}"
        )
    path = write_json(
        "workers.json",
        {"machine": machine(), "concurrency": args.concurrency, "seconds": args.seconds, "results": results},
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
