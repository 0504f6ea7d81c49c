"""The HTTP path's cost: proxy CPU per streamed chat turn against ``prefixgate sim``, side by side.

Each system is its own ``prefixgate serve`` process in front of the same simulated rank, and every
round sends each, in a rotated order, the same streamed turns, ``--concurrency`` at a time, each
stream read to its end; its process's CPU time (user + system) is read around each batch:

- ``guarded``: prefixgate from this tree as it serves, with the client-connection guards of
  ``proxy/connections.py`` (header and body timeouts, the connection cap);
- ``plain_protocol``: the same with uvicorn's own httptools protocol in their place;
- with ``--baseline-root DIR``: prefixgate from that source tree (a worktree of another commit).

Cases: ``small``, a one-line chat answered in 16 streamed tokens; ``100k``, a ~100k-token
conversation (~250 KB of JSON) sent again by each session (its prefix cached, its body read and
parsed each time). Prints, per case, each system's median CPU ms per turn and turns/s over the
rounds. (Its ``--clients`` comparison of aiohttp and httpx, behind the choice of aiohttp, was
deleted after ``deae4c4``.)

    python -m bench.http_path [--rounds 9] [--turns 600] [--large-turns 40] [--concurrency 8]
        [--baseline-root DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson

from bench.common import stop_process, wait_until_up
from bench.rounds import rotation
from bench.systems import ProcessCpu
from proxy.server import free_port

#: ``prefixgate serve`` with uvicorn's own protocol in place of the guarded one (measurement only).
PLAIN_PROTOCOL = (
    "import sys, proxy.server; proxy.server.protocol_factory = lambda *limits: 'httptools'; "
    "from proxy.cli import main; sys.exit(main(sys.argv[1:]))"
)
CODE = "def function_{i}(x):\n    return x * {i} + helper(x - {i})\n"


def chat(content: str, max_tokens: int) -> bytes:
    message = {"role": "user", "content": content}
    body = {"model": "prefixgate-sim", "messages": [message], "stream": True, "max_tokens": max_tokens}
    return orjson.dumps(body)


def cases(args: argparse.Namespace) -> dict[str, tuple[bytes, int]]:
    large = "".join(CODE.format(i=i) for i in range(4_600))  # ~100k tokens, ~250 KB
    return {"small": (chat("hi", 16), args.turns), "100k": (chat(large, 4), args.large_turns)}


async def send(url: str, body: bytes, turns: int, sessions: str, concurrency: int) -> None:
    left = turns
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as client:

        async def worker(number: int) -> None:
            nonlocal left
            headers = {"content-type": "application/json", "x-session-id": f"{sessions}-{number}"}
            while left > 0:
                left -= 1
                async with client.post(url + "/v1/chat/completions", data=body, headers=headers) as answer:
                    if answer.status != 200:
                        raise RuntimeError(f"{url}: HTTP {answer.status}: {await answer.text()}")
                    async for _ in answer.content.iter_any():
                        pass

        await asyncio.gather(*(worker(n) for n in range(concurrency)))


@contextlib.contextmanager
def started(command: list[str], url: str, root: str) -> Iterator[int]:
    """``command`` run from source tree ``root`` until ``url`` answers; yields its PID."""
    env = {**os.environ, "PYTHONPATH": root}
    process = subprocess.Popen(
        command, env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_until_up(url + "/health", 60.0, process)
        yield process.pid
    finally:
        stop_process(process)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=9, help="rounds, systems in a rotated order each")
    parser.add_argument("--turns", type=int, default=600, help="small turns per system and round")
    parser.add_argument("--large-turns", type=int, default=40, help="100k turns per system and round")
    parser.add_argument("--concurrency", type=int, default=8, help="turns in flight at once")
    parser.add_argument("--baseline-root", type=Path, help="also run prefixgate from this source tree")
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parent.parent)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as config, contextlib.ExitStack() as stack:
        config.write("tokenization:\n  kind: tiktoken\n")  # the simulated rank's own tokens
        config.flush()
        sim_port = free_port()
        sim_url = f"http://127.0.0.1:{sim_port}"
        sim = [sys.executable, "-m", "proxy.cli", "sim", "--port", str(sim_port), "--time-scale", "0.1"]
        stack.enter_context(started(sim, sim_url, here))
        serve = ["serve", "--backend", sim_url, "--config", config.name, "--log-level", "warning"]
        commands = {
            "guarded": ([sys.executable, "-m", "proxy.cli"], here),
            "plain_protocol": ([sys.executable, "-c", PLAIN_PROTOCOL], here),
        }
        if args.baseline_root is not None:
            commands["baseline"] = ([sys.executable, "-m", "proxy.cli"], str(args.baseline_root.resolve()))
        systems: dict[str, tuple[str, int]] = {}
        for name, (command, root) in commands.items():
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            systems[name] = (
                url,
                stack.enter_context(started([*command, *serve, "--port", str(port)], url, root)),
            )
        work = cases(args)
        for url, _ in systems.values():  # warm-up: the first turns, the large prompt's prefill
            for case, (body, _turns) in work.items():
                asyncio.run(send(url, body, 2 * args.concurrency, f"warm-{case}", args.concurrency))
        cpu: dict[str, dict[str, list[float]]] = {case: {name: [] for name in systems} for case in work}
        rate: dict[str, dict[str, list[float]]] = {case: {name: [] for name in systems} for case in work}
        names = list(systems)
        for round_ in range(args.rounds):
            for name in rotation(names, round_):
                url, pid = systems[name]
                for case, (body, turns) in work.items():
                    process, start = ProcessCpu(pid), time.perf_counter()
                    process.start()
                    asyncio.run(send(url, body, turns, f"{case}-r{round_}", args.concurrency))
                    process.stop()
                    wall = time.perf_counter() - start
                    assert process.seconds is not None
                    cpu[case][name].append(process.seconds * 1000 / turns)
                    rate[case][name].append(turns / wall)
    print(
        f"proxy CPU ms per streamed chat turn, median of {args.rounds} rounds",
        f"(concurrency {args.concurrency})",
    )
    for case in work:
        print(f"{case}:")
        for name in names:
            samples = cpu[case][name]
            print(
                f"  {name:<16} {statistics.median(samples):7.3f} ms (min {min(samples):.3f}, "
                f"max {max(samples):.3f})  {statistics.median(rate[case][name]):6.0f} turns/s"
            )


if __name__ == "__main__":
    main()
