"""Latency the proxy adds, measured side by side against a fast stub rank.

Each sample sends the same request once directly to the rank and once through prefixgate
(alternating, so both see the same machine noise). The rank and the proxy run in their own
processes. Reports medians and p99 of both and their difference, for a small chat request and a
100k-token one (~400 KB of JSON), non-streaming (full response) and streaming (time to first
byte), then requests per second at concurrency 64 through the proxy and directly.

    python -m bench.overhead [--samples 300] [--seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import time
from typing import Any

import httpx
import orjson

from bench.common import machine, median, percentile, proxy_process, stub_rank_process, write_json

TARGET_ADDED_P50_MS = {"small": 1.0, "100k": 3.0}


def small_request(stream: bool) -> bytes:
    body: dict[str, Any] = {
        "model": "stub-model",
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 16,
        "stream": stream,
    }
    return orjson.dumps(body)


def large_request(stream: bool, approx_tokens: int = 100_000) -> bytes:
    """A coding-agent-shaped conversation of about ``approx_tokens`` tokens (~4 characters each)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. " * 200}]
    turn = 0
    text = "def function_{i}(x):\n    return x * {i} + helper(x - {i})\n"
    while sum(len(m["content"]) for m in messages) < approx_tokens * 4:
        messages.append(
            {"role": "user", "content": f"Turn {turn}: " + "".join(text.format(i=i) for i in range(40))}
        )
        messages.append({"role": "assistant", "content": f"Done with step {turn}. " * 20})
        turn += 1
    body = {"model": "stub-model", "messages": messages, "max_tokens": 16, "stream": stream}
    return orjson.dumps(body)


def time_request(client: httpx.Client, url: str, body: bytes, stream: bool) -> float:
    """Seconds until the full response (non-streaming) or its first byte (streaming)."""
    headers = {"content-type": "application/json"}
    start = time.perf_counter()
    if not stream:
        response = client.post(url, content=body, headers=headers)
        elapsed = time.perf_counter() - start
        response.raise_for_status()
        return elapsed
    with client.stream("POST", url, content=body, headers=headers) as response:
        response.raise_for_status()
        elapsed = 0.0
        for _ in response.iter_raw():
            if not elapsed:
                elapsed = time.perf_counter() - start
    return elapsed


def side_by_side(direct: str, proxied: str, body: bytes, stream: bool, samples: int) -> dict[str, float]:
    path = "/v1/chat/completions"
    with httpx.Client(timeout=30) as client:
        for _ in range(10):  # warm up both paths
            time_request(client, direct + path, body, stream)
            time_request(client, proxied + path, body, stream)
        direct_s: list[float] = []
        proxied_s: list[float] = []
        for _ in range(samples):
            direct_s.append(time_request(client, direct + path, body, stream))
            proxied_s.append(time_request(client, proxied + path, body, stream))
    ms = 1000.0
    result = {
        "direct_p50_ms": median(direct_s) * ms,
        "proxy_p50_ms": median(proxied_s) * ms,
        "direct_p99_ms": percentile(direct_s, 99) * ms,
        "proxy_p99_ms": percentile(proxied_s, 99) * ms,
        "added_p50_ms": median([p - d for p, d in zip(proxied_s, direct_s, strict=True)]) * ms,
    }
    result["added_p99_ms"] = result["proxy_p99_ms"] - result["direct_p99_ms"]
    return result


async def throughput(url: str, body: bytes, concurrency: int, seconds: float) -> dict[str, float]:
    """Closed-loop load with aiohttp (httpx's own pool caps near 100 req/s at concurrency 64)."""
    import aiohttp

    done = 0
    errors = 0
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as client:

        async def worker() -> None:
            nonlocal done, errors
            while time.perf_counter() < deadline:
                try:
                    async with client.post(
                        url + "/v1/chat/completions", data=body, headers=headers
                    ) as response:
                        await response.read()
                        if response.status == 200:
                            done += 1
                        else:
                            errors += 1
                except aiohttp.ClientError:
                    errors += 1

        start = time.perf_counter()
        deadline = start + seconds
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return {"requests_per_s": done / elapsed, "errors": errors, "completed": done}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=300, help="pairs of requests per case (default 300)")
    parser.add_argument(
        "--large-samples", type=int, default=60, help="pairs for the 100k-token case (default 60)"
    )
    parser.add_argument(
        "--seconds", type=float, default=5.0, help="duration of each throughput run (default 5)"
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--proxy-args",
        default="",
        help="extra 'prefixgate serve' flags, e.g. '--policy round_robin --no-canonicalize --no-admission' "
        "(the pass-through pipeline); default: prefixgate's defaults",
    )
    args = parser.parse_args()

    rank, rank_url = stub_rank_process()
    with rank:
        proxy, proxy_url = proxy_process([rank_url], extra=shlex.split(args.proxy_args))
        with proxy:
            cases: dict[str, dict[str, float]] = {}
            for size, build, samples in (
                ("small", small_request, args.samples),
                ("100k", large_request, args.large_samples),
            ):
                for stream in (False, True):
                    name = f"{size} {'stream ttfb' if stream else 'non-stream'}"
                    cases[name] = side_by_side(rank_url, proxy_url, build(stream), stream, samples)
            small = small_request(False)
            rps = {
                "proxy": asyncio.run(throughput(proxy_url, small, args.concurrency, args.seconds)),
                "direct": asyncio.run(throughput(rank_url, small, args.concurrency, args.seconds)),
            }

    print(f"prefixgate serve {args.proxy_args or '(defaults)'}")
    print(
        f"{'case':<24}{'direct p50':>11}{'proxy p50':>11}{'added p50':>11}{'direct p99':>11}{'proxy p99':>11}"
    )
    for name, r in cases.items():
        print(
            f"{name:<24}{r['direct_p50_ms']:>9.2f}ms{r['proxy_p50_ms']:>9.2f}ms{r['added_p50_ms']:>9.2f}ms"
            f"{r['direct_p99_ms']:>9.2f}ms{r['proxy_p99_ms']:>9.2f}ms"
        )
    proxy_rps, direct_rps = rps["proxy"], rps["direct"]
    print(
        f"\nconcurrency {args.concurrency}, small non-streaming: "
        f"proxy {proxy_rps['requests_per_s']:.0f} req/s ({proxy_rps['errors']} errors), "
        f"direct {direct_rps['requests_per_s']:.0f} req/s (client, proxy and rank share this machine's cores)"
    )
    verdicts = []
    for size, target in TARGET_ADDED_P50_MS.items():
        added = cases[f"{size} non-stream"]["added_p50_ms"]
        verdict = "OK" if added <= target else "MISSED"
        verdicts.append(f"{size}: added p50 {added:.2f} ms (target <= {target} ms) {verdict}")
    print("\n".join(verdicts))
    suffix = "" if not args.proxy_args else "_" + "_".join(a.strip("-") for a in shlex.split(args.proxy_args))
    path = write_json(
        f"overhead{suffix}.json",
        {
            "machine": machine(),
            "samples": args.samples,
            "proxy_args": args.proxy_args or "(defaults)",
            "cases": cases,
            "throughput": rps,
            "targets_ms": TARGET_ADDED_P50_MS,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
