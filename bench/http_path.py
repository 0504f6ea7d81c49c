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
rounds.

With ``--clients`` it compares the two HTTP clients instead, on the jobs prefixgate gives its client
to the ranks: streamed chat turns read to their end, then ``POST /tokenize`` of a ~50 KB chat. Each
round runs the job once with aiohttp and once with httpx, each in a process of its own, and reads
that process's CPU time spent on the job (imports excluded); prints the medians and the median of
the rounds' aiohttp/httpx ratios.

    python -m bench.http_path [--rounds 9] [--turns 600] [--large-turns 40] [--concurrency 8]
        [--baseline-root DIR] [--clients]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import aiohttp
import orjson
import psutil

#: ``prefixgate serve`` with uvicorn's own protocol in place of the guarded one (measurement only).
PLAIN_PROTOCOL = (
    "import sys, proxy.server; proxy.server.protocol_factory = lambda *limits: 'httptools'; "
    "from proxy.cli import main; sys.exit(main(sys.argv[1:]))"
)
CODE = "def function_{i}(x):\n    return x * {i} + helper(x - {i})\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_up(url: str, process: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the process exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


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


async def client_job(name: str, url: str, turns: int, concurrency: int) -> None:
    """``turns`` streamed chat turns, then a tenth as many ``/tokenize`` calls, through ``name``."""
    turn = chat("hi", 16)
    tokenize = orjson.dumps(
        {"messages": [{"role": "user", "content": CODE * 900}], "add_generation_prompt": True}
    )
    headers = {"content-type": "application/json"}

    async def drive(job: Callable[[], Awaitable[None]], count: int) -> None:
        left = count

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                await job()

        await asyncio.gather(*(worker() for _ in range(concurrency)))

    if name == "aiohttp":
        async with aiohttp.ClientSession(raise_for_status=True) as session:

            async def streamed() -> None:
                async with session.post(url + "/v1/chat/completions", data=turn, headers=headers) as answer:
                    async for _ in answer.content.iter_any():
                        pass

            async def tokens() -> None:
                async with session.post(url + "/tokenize", data=tokenize, headers=headers) as answer:
                    orjson.loads(await answer.read())

            await drive(streamed, turns)
            await drive(tokens, turns // 10)
        return
    import httpx

    async def check(answer: httpx.Response) -> None:
        answer.raise_for_status()

    async with httpx.AsyncClient(trust_env=False, event_hooks={"response": [check]}) as client:

        async def streamed_httpx() -> None:
            async with client.stream(
                "POST", url + "/v1/chat/completions", content=turn, headers=headers
            ) as answer:
                async for _ in answer.aiter_raw():
                    pass

        async def tokens_httpx() -> None:
            orjson.loads((await client.post(url + "/tokenize", content=tokenize, headers=headers)).content)

        await drive(streamed_httpx, turns)
        await drive(tokens_httpx, turns // 10)


def compare_clients(args: argparse.Namespace, sim_url: str, root: str) -> None:
    cpu: dict[str, list[float]] = {"aiohttp": [], "httpx": []}
    for round_ in range(args.rounds):
        for name in ("aiohttp", "httpx") if round_ % 2 == 0 else ("httpx", "aiohttp"):
            job = [sys.executable, "-m", "bench.http_path", "--client-job", name, "--url", sim_url]
            job += ["--turns", str(args.turns), "--concurrency", str(args.concurrency)]
            env = {**os.environ, "PYTHONPATH": root}
            done = subprocess.run(job, check=True, capture_output=True, text=True, env=env, cwd=root)
            cpu[name].append(float(done.stdout))
    ratios = [a / b for a, b in zip(cpu["aiohttp"], cpu["httpx"], strict=True)]
    print(f"client CPU s for {args.turns} streamed turns and {args.turns // 10} /tokenize calls, ", end="")
    print(f"concurrency {args.concurrency}, median of {args.rounds} rounds")
    for name, samples in cpu.items():
        print(
            f"  {name:<8} {statistics.median(samples):7.3f} s",
            f"(min {min(samples):.3f}, max {max(samples):.3f})",
        )
    print(f"  aiohttp/httpx {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})")


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


@contextlib.contextmanager
def started(command: list[str], url: str, env: dict[str, str], cwd: str | None) -> Iterator[int]:
    process = subprocess.Popen(
        command, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        wait_up(url + "/health", process)
        yield process.pid
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=9, help="rounds, systems in a rotated order each")
    parser.add_argument("--turns", type=int, default=600, help="small turns per system and round")
    parser.add_argument("--large-turns", type=int, default=40, help="100k turns per system and round")
    parser.add_argument("--concurrency", type=int, default=8, help="turns in flight at once")
    parser.add_argument("--baseline-root", type=Path, help="also run prefixgate from this source tree")
    parser.add_argument("--clients", action="store_true", help="compare aiohttp and httpx instead")
    parser.add_argument("--client-job", choices=("aiohttp", "httpx"), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client_job:  # one client's job, in this process of its own: prints its CPU seconds
        start = time.process_time()
        asyncio.run(client_job(args.client_job, args.url, args.turns, args.concurrency))
        print(f"{time.process_time() - start:.4f}")
        return
    here = str(Path(__file__).resolve().parent.parent)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as config, contextlib.ExitStack() as stack:
        config.write("tokenization:\n  kind: tiktoken\n")  # the simulated rank's own tokens
        config.flush()
        sim_port = free_port()
        sim_url = f"http://127.0.0.1:{sim_port}"
        sim = [sys.executable, "-m", "proxy.cli", "sim", "--port", str(sim_port), "--time-scale", "0.1"]
        stack.enter_context(started(sim, sim_url, {**os.environ, "PYTHONPATH": here}, here))
        if args.clients:
            compare_clients(args, sim_url, here)
            return
        serve = ["serve", "--backend", sim_url, "--config", config.name, "--log-level", "warning"]
        commands = {
            "guarded": ([sys.executable, "-m", "proxy.cli"], here),
            "plain_protocol": ([sys.executable, "-c", PLAIN_PROTOCOL], here),
        }
        if args.baseline_root is not None:
            commands["baseline"] = ([sys.executable, "-m", "proxy.cli"], str(args.baseline_root.resolve()))
        systems: dict[str, tuple[str, psutil.Process]] = {}
        for name, (command, root) in commands.items():
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            pid = stack.enter_context(
                started(
                    [*command, *serve, "--port", str(port)], url, {**os.environ, "PYTHONPATH": root}, root
                )
            )
            systems[name] = (url, psutil.Process(pid))
        work = cases(args)
        for url, _ in systems.values():  # warm-up: the first turns, the large prompt's prefill
            for case, (body, _turns) in work.items():
                asyncio.run(send(url, body, 2 * args.concurrency, f"warm-{case}", args.concurrency))
        cpu: dict[str, dict[str, list[float]]] = {case: {name: [] for name in systems} for case in work}
        rate: dict[str, dict[str, list[float]]] = {case: {name: [] for name in systems} for case in work}
        names = list(systems)
        for round_ in range(args.rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for name in order:
                url, process = systems[name]
                for case, (body, turns) in work.items():
                    before, start = cpu_seconds(process), time.perf_counter()
                    asyncio.run(send(url, body, turns, f"{case}-r{round_}", args.concurrency))
                    wall = time.perf_counter() - start
                    cpu[case][name].append((cpu_seconds(process) - before) * 1000 / turns)
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
