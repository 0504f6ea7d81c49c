"""CPU per request of each proxy on the streams agents send, against the same stub rank.

``prefixgate bench`` gives one CPU figure per system over a whole trace replay; this splits it by the
shape of the turn, so a difference can be traced to what costs it. Each system gets, in turn and
several rounds, the same streamed requests, four at a time, and its process's CPU time (user +
system, every thread) is read around each workload:

- ``small``: a one-line chat request, whose cost is mostly relaying its stream's chunks;
- ``repeat_100k``: sessions re-sending the same ~100k-token conversation (nothing new to tokenize);
- ``growing``: ~100k-token conversations growing by ~1k tokens a turn (the shape agents send most);
- ``first_turns``: the first turn of each growing conversation (its whole prompt is new).

Systems: prefixgate from this tree with its defaults, optionally from another tree (``--baseline-root``),
``plain``: prefixgate with every stage off (``--policy round_robin --no-canonicalize --no-admission``:
the HTTP path alone), and with ``--peers`` sglang-router cache_aware. The stub rank spaces a stream's
chunks (``--chunk-delay``, as a model's decode does), so each chunk costs what a live stream's does.
First turns are timed apart and followed by a pause, so the tokenization they leave running beside
the answer is charged to them. Prints medians over ``--rounds`` and writes ``bench/out/proxy_cpu.json``.

    python -m bench.proxy_cpu [--rounds 3] [--turns 30] [--chunks 8] [--chunk-delay 0.002] [--peers]
        [--baseline-root DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import time
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import psutil

from bench.common import (
    embedded_tokenizer_config,
    machine,
    median,
    proxy_process,
    stub_rank_process,
    write_json,
)
from bench.overhead import large_request
from bench.process_cpu import cpu_seconds, idle_share
from bench.side_by_side import PATH, System, growing_conversation, proxies

PLAIN_ARGS = ["--policy", "round_robin", "--no-canonicalize", "--no-admission"]
CONCURRENCY = 4
#: Seconds after the first turns for what they left running (their whole prompt's tokenization).
SETTLE_S = 1.5
Request = tuple[bytes, str]  # body, session id


async def _send_all(url: str, requests: list[Request]) -> None:
    """``requests`` through ``url``, ``CONCURRENCY`` at a time, each stream read to its end."""
    queue = list(reversed(requests))
    async with aiohttp.ClientSession() as client:

        async def worker() -> None:
            while queue:
                body, session = queue.pop()
                headers = {"content-type": "application/json", "x-session-id": session}
                async with client.post(url + PATH, data=body, headers=headers) as response:
                    response.raise_for_status()
                    async for _ in response.content.iter_any():
                        pass

        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


def _cpu_ms_per_request(process: psutil.Process, url: str, requests: list[Request]) -> float:
    before = cpu_seconds(process)
    asyncio.run(_send_all(url, requests))
    return (cpu_seconds(process) - before) * 1000 / len(requests)


def _streamed(body: bytes) -> bytes:
    parsed = orjson.loads(body)
    parsed["stream"] = True
    return orjson.dumps(parsed)


def workloads(turns: int) -> dict[str, list[Request]]:
    """The four workloads (built once: each round tags their session ids afresh)."""
    big = large_request(stream=True)
    conversations = [
        [_streamed(b) for b in growing_conversation(100_000, 1_000, turns, seed)] for seed in range(4)
    ]
    message = {"role": "user", "content": "hi"}
    small = orjson.dumps({"model": "stub-model", "messages": [message], "stream": True, "max_tokens": 8})
    return {
        "small": [(small, f"small-{i % CONCURRENCY}") for i in range(turns * CONCURRENCY)],
        "repeat_100k": [(big, f"repeat-{i % CONCURRENCY}") for i in range(turns * CONCURRENCY)],
        "first_turns": [(c[0], f"growing-{i}") for i, c in enumerate(conversations)],
        "growing": [(c[t], f"growing-{i}") for t in range(1, turns) for i, c in enumerate(conversations)],
    }


def measure(system: System, workload: dict[str, list[Request]], tag: str, idle: float) -> dict[str, float]:
    """``system``'s CPU ms per request on each workload, its sessions named after ``tag`` (fresh
    ones each round); ``idle``: its share of a core at rest, taken off the pause after the first turns."""
    assert system.pid is not None
    process = psutil.Process(system.pid)
    work = {case: [(body, f"{tag}-{s}") for body, s in requests] for case, requests in workload.items()}
    out: dict[str, float] = {"small": _cpu_ms_per_request(process, system.url, work["small"])}
    # a repeated conversation's first request is a first turn: sent before its clock starts
    asyncio.run(_send_all(system.url, work["repeat_100k"][:CONCURRENCY]))
    time.sleep(SETTLE_S)
    out["repeat_100k"] = _cpu_ms_per_request(process, system.url, work["repeat_100k"][CONCURRENCY:])
    before = cpu_seconds(process)
    asyncio.run(_send_all(system.url, work["first_turns"]))
    time.sleep(SETTLE_S)  # what they left running beside their answers is theirs
    spent = cpu_seconds(process) - before - SETTLE_S * idle
    out["first_turns"] = spent * 1000 / len(work["first_turns"])
    out["growing"] = _cpu_ms_per_request(process, system.url, work["growing"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds, systems in a rotated order each")
    parser.add_argument("--turns", type=int, default=30, help="turns per growing conversation")
    parser.add_argument(
        "--chunk-delay", type=float, default=0.002, help="seconds between a stream's chunks (0: at once)"
    )
    parser.add_argument(
        "--chunks", type=int, default=8, help="content chunks per streamed answer (vLLM: one per token)"
    )
    parser.add_argument("--baseline-root", type=Path, help="also run prefixgate from this source tree")
    parser.add_argument("--peers", action="store_true", help="also run sglang-router cache_aware")
    args = parser.parse_args()
    tokenizer = embedded_tokenizer_config()  # the stub's /tokenize is not a model's (common.py)
    atexit.register(tokenizer.unlink)
    flags = ["--config", str(tokenizer)]
    rank, rank_url = stub_rank_process(chunks=args.chunks, chunk_delay=args.chunk_delay)
    samples: dict[str, dict[str, list[float]]] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(rank)
        systems = stack.enter_context(proxies(rank_url, flags, args.baseline_root, args.peers))
        plain, url = proxy_process([rank_url], extra=flags + PLAIN_ARGS)
        systems.insert(1, System("plain", url, stack.enter_context(plain).pid))
        idle = {s.name: idle_share(psutil.Process(s.pid), 2.0) for s in systems if s.pid is not None}
        workload = workloads(args.turns)
        for round_ in range(args.rounds):
            shift = round_ % len(systems)
            for system in systems[shift:] + systems[:shift]:
                for case, value in measure(system, workload, f"r{round_}", idle[system.name]).items():
                    samples.setdefault(system.name, {}).setdefault(case, []).append(value)
    report(args, samples, idle)


def report(
    args: argparse.Namespace, samples: dict[str, dict[str, list[float]]], idle: dict[str, float]
) -> None:
    cases = ("small", "repeat_100k", "growing", "first_turns")
    print(f"proxy CPU ms per request, median of {args.rounds} rounds")
    print(f"(streams of {args.chunks} chunks {args.chunk_delay} s apart, {CONCURRENCY} requests at a time)")
    print(f"{'system':<30}" + "".join(f"{c:>14}" for c in cases))
    results: dict[str, Any] = {}
    for name, by_case in samples.items():
        results[name] = {c: {"median_ms": median(v), "rounds_ms": v} for c, v in by_case.items()}
        print(f"{name:<30}" + "".join(f"{median(by_case[c]):>14.2f}" for c in cases))
    path = write_json(
        "proxy_cpu.json",
        {
            "machine": machine(),
            "rounds": args.rounds,
            "turns": args.turns,
            "chunks": args.chunks,
            "chunk_delay_s": args.chunk_delay,
            "idle_share": idle,
            "systems": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
