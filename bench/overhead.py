"""Latency the proxy adds, measured side by side against a fast stub rank.

Each sample sends the same request straight to the rank and through every proxy under test, in
turn (``bench/side_by_side.py``: interleaved, so all see the same machine noise). The rank and the
proxies run in their own processes. Reports medians and p99 and the added p50 over the rank, for a
small chat request and a 100k-token one (~400 KB of JSON), non-streaming (full response) and
streaming (time to first byte); then the growing conversation agents send most: a ~100k-token
conversation growing by ~1k tokens a turn, every turn to each system (each keeps its own session);
then requests per second at concurrency 64 through prefixgate and directly.

Systems: prefixgate from this tree; with ``--baseline-root DIR`` also prefixgate from that source
tree (the "before" of a change, e.g. a worktree of main); with ``--peers`` also sglang-router
cache_aware (``bench/peers/install.sh``).

    python -m bench.overhead [--samples 300] [--large-samples 60] [--seconds 5]
        [--growing-turns 30] [--growing-conversations 2] [--growing-step 1000]
        [--baseline-root DIR] [--peers]
        [--cases small,100k,growing,throughput]

Without a ``--config`` in ``--proxy-args`` the proxies pin the embedded tokenizer: the stub rank's
``/tokenize`` is not a model's, and discovery would pick it (a round trip per turn).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import re
import shlex
import time
from pathlib import Path
from typing import Any

import orjson

from bench.common import embedded_tokenizer_config, machine, stub_rank_process, write_json
from bench.side_by_side import growing_conversation, interleaved, proxies

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
    parser.add_argument("--samples", type=int, default=300, help="samples per small case (default 300)")
    parser.add_argument(
        "--large-samples", type=int, default=60, help="samples per 100k-token case (default 60)"
    )
    parser.add_argument("--growing-turns", type=int, default=30, help="turns per conversation (default 30)")
    parser.add_argument(
        "--growing-conversations", type=int, default=2, help="growing conversations (default 2)"
    )
    parser.add_argument(
        "--growing-step",
        type=int,
        default=1000,
        help="tokens each turn of a growing conversation adds (default 1000; 10000: a large file read)",
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
    parser.add_argument("--baseline-root", type=Path, help="also run prefixgate from this source tree")
    parser.add_argument("--peers", action="store_true", help="also run sglang-router cache_aware")
    parser.add_argument("--cases", default="small,100k,growing,throughput", help="which parts to run")
    args = parser.parse_args()
    parts = {c.strip() for c in args.cases.split(",")}

    proxy_args = shlex.split(args.proxy_args)
    if "--config" not in proxy_args:  # the stub's /tokenize is not a model's (common.py)
        tokenizer = embedded_tokenizer_config()
        atexit.register(tokenizer.unlink)
        proxy_args += ["--config", str(tokenizer)]
    rank, rank_url = stub_rank_process()
    cases: dict[str, dict[str, dict[str, float]]] = {}
    rps: dict[str, Any] = {}
    with rank, proxies(rank_url, proxy_args, args.baseline_root, args.peers) as systems:
        for size, build, samples in (
            ("small", small_request, args.samples),
            ("100k", large_request, args.large_samples),
        ):
            if size not in parts:
                continue
            for stream in (False, True):
                body = build(stream)
                interleaved(rank_url, systems, [body] * 10, stream)  # warm up every path
                name = f"{size} {'stream ttfb' if stream else 'non-stream'}"
                cases[name] = interleaved(rank_url, systems, [body] * samples, stream)
        if "growing" in parts:
            bodies: list[bytes] = []
            labels: list[str] = []
            for c in range(args.growing_conversations):
                turns = growing_conversation(100_000, args.growing_step, args.growing_turns, seed=c)
                bodies += turns
                labels += [f"conversation-{c}"] * len(turns)
            cases["growing non-stream"] = interleaved(rank_url, systems, bodies, False, labels)
        if "throughput" in parts:
            small = small_request(False)
            rps = {
                "proxy": asyncio.run(throughput(systems[0].url, small, args.concurrency, args.seconds)),
                "direct": asyncio.run(throughput(rank_url, small, args.concurrency, args.seconds)),
            }
    report(args, [s.name for s in systems], cases, rps)


def report(
    args: argparse.Namespace,
    names: list[str],
    cases: dict[str, dict[str, dict[str, float]]],
    rps: dict[str, Any],
) -> None:
    print(f"prefixgate serve {args.proxy_args or '(defaults)'}")
    print(f"{'case':<22}{'system':<28}{'p50':>9}{'p99':>10}{'added p50':>11}{'added p99':>11}")
    for case, results in cases.items():
        direct = results["direct"]
        print(f"{case:<22}{'direct':<28}{direct['p50_ms']:>7.2f}ms{direct['p99_ms']:>8.2f}ms")
        for name in names:
            r = results[name]
            print(
                f"{'':<22}{name:<28}{r['p50_ms']:>7.2f}ms{r['p99_ms']:>8.2f}ms"
                f"{r['added_p50_ms']:>9.2f}ms{r['added_p99_ms']:>9.2f}ms"
            )
    if rps:
        proxy_rps, direct_rps = rps["proxy"], rps["direct"]
        print(
            f"\nconcurrency {args.concurrency}, small non-streaming: "
            f"proxy {proxy_rps['requests_per_s']:.0f} req/s ({proxy_rps['errors']} errors), "
            f"direct {direct_rps['requests_per_s']:.0f} req/s "
            "(client, proxy and rank share this machine's cores)"
        )
    print("\n".join(verdicts(cases)))
    # a flag's value may be a path: only its file name's safe characters name the JSON
    words = [re.sub(r"[^A-Za-z0-9_.]+", "_", Path(a).name).strip("_.") for a in shlex.split(args.proxy_args)]
    suffix = "".join(f"_{w}" for w in words if w)
    path = write_json(
        f"overhead{suffix}.json",
        {
            "machine": machine(),
            "samples": args.samples,
            "proxy_args": args.proxy_args or "(defaults)",
            "systems": names,
            "cases": cases,
            "throughput": rps,
            "targets_ms": TARGET_ADDED_P50_MS,
        },
    )
    print(f"wrote {path}")


def verdicts(cases: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """prefixgate's added p50 against the targets: small <= 1 ms and 100k <= 3 ms (streaming TTFB
    likewise), and on the growing conversation at or below sglang-router's."""
    out = []
    for case, results in cases.items():
        added = results["prefixgate"]["added_p50_ms"]
        size = case.split()[0]
        if size in TARGET_ADDED_P50_MS:
            target = TARGET_ADDED_P50_MS[size]
            verdict = "OK" if added <= target else "MISSED"
            out.append(f"{case}: added p50 {added:.2f} ms (target <= {target} ms) {verdict}")
        elif "sglang cache_aware" in results:
            peer = results["sglang cache_aware"]["added_p50_ms"]
            verdict = "OK" if added <= peer else "MISSED"
            out.append(f"{case}: added p50 {added:.2f} ms, sglang-router cache_aware {peer:.2f} ms {verdict}")
    return out


if __name__ == "__main__":
    main()
