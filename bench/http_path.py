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
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp
import orjson

from bench.rounds import rotation
from bench.systems import FleetConfig, ProcessCpu, SimFleetProcess, SystemSpec, system_under_test
from routing.policies import DEFAULT_POLICY

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
    with tempfile.TemporaryDirectory() as logs, contextlib.ExitStack() as stack:
        config = Path(logs) / "tiktoken.yaml"
        config.write_text("tokenization:\n  kind: tiktoken\n")  # the simulated rank's own tokens
        sim = stack.enter_context(SimFleetProcess(FleetConfig(ranks=1, time_scale=0.1)))
        flags = ("--config", str(config))
        specs = [
            SystemSpec("guarded", "prefixgate", DEFAULT_POLICY, args=flags),
            SystemSpec(
                "plain_protocol", "prefixgate", DEFAULT_POLICY, args=flags, launcher=("-c", PLAIN_PROTOCOL)
            ),
        ]
        if args.baseline_root is not None:
            root = args.baseline_root.resolve()
            specs.append(SystemSpec("baseline", "prefixgate", DEFAULT_POLICY, args=flags, root=root))
        systems = {
            spec.name: stack.enter_context(system_under_test(spec, sim.urls, Path(logs))) for spec in specs
        }
        work = cases(args)
        for system in systems.values():  # warm-up: the first turns, the large prompt's prefill
            for case, (body, _turns) in work.items():
                asyncio.run(send(system.url, body, 2 * args.concurrency, f"warm-{case}", args.concurrency))
        cpu: dict[str, dict[str, list[float]]] = {case: {name: [] for name in systems} for case in work}
        rate: dict[str, dict[str, list[float]]] = {case: {name: [] for name in systems} for case in work}
        names = list(systems)
        for round_ in range(args.rounds):
            for name in rotation(names, round_):
                for case, (body, turns) in work.items():
                    process, start = ProcessCpu(systems[name].pid), time.perf_counter()
                    process.start()
                    asyncio.run(send(systems[name].url, body, turns, f"{case}-r{round_}", args.concurrency))
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
