"""Throughput of ``prefixgate serve --workers N``: requests/s at high concurrency with 100k-token prompts.

Fast stub ranks (own processes) stand in for vLLM. ``--concurrency`` sessions each loop on their own
~100k-token conversation (a returning agent's turn: the conversation re-sent with a small new
message), non-streaming, through:

- ``1 (memory)``: one process, state in memory (the single-process baseline);
- ``1 (redis)``: one process, state in a Redis server (what sharing state costs, without a second
  process to share it with);
- ``N workers``: ``serve --workers N`` (N processes sharing an embedded Redis) for each N given.
``--proxy-root DIR`` runs every configuration from that source tree too, right after this one's.

Each configuration runs two phases:

- **first turns**: every session sends its first turn at once (``--concurrency`` 100k-token
  conversations prefixgate has never seen: tokenized, hashed and recorded whole); the phase lasts
  until the last one is answered, and its length is reported;
- **steady**: the sessions' returning turns, counted for ``--seconds`` once every session has taken
  two (a first turn is answered before it is tokenized whole; its next turn waits for that).

Per configuration and phase: requests/s, p50/p99 latency and errors, then the steady phase's CPU
per request of the proxy's processes and of Redis (from ``/proc``: what a turn costs, however many
cores there are) and Redis commands per request (the embedded server's own counters: every command
prefixgate sent, an upper bound of its round trips, which pipelining batches). ``req/s per core``
is 1 / CPU per request: what one core of proxy processes serves, the figure that shows whether
sharing state makes each request dearer. Client, ranks, Redis and proxies share this machine's
cores, so the raw req/s cannot grow past them (``cores`` is printed; the client's own CPU share
says whether it kept up): on a machine with C cores, N workers can scale up to about C - 1.
Writes ``bench/out/workers.json``::

    python -m bench.workers [--workers 2,4] [--concurrency 256] [--seconds 20] [--session-memory-mb MB]
        [--proxy-root DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from pathlib import Path
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
    positive_seconds,
    proxy_process,
    redis_server,
    stub_rank_process,
    write_json,
)
from bench.overhead import large_request
from bench.process_cpu import cpu_seconds

#: Every process's ``--session-memory-mb`` unless told: room for all sessions' kept turns (~1.5 MB
#: each), so that configurations compare what a turn costs, not how many sessions one process holds.
SESSION_MEMORY_MB = 2048.0
#: Returning turns each session takes before the steady phase's window opens.
WARMUP_TURNS = 2
#: The longest a first-turn wave may take before the run is called failed.
FIRST_TURNS_TIMEOUT_S = 600.0
HEADERS = {"content-type": "application/json"}


class Conversations:
    """Each session's next request body, from bytes: the shared ~100k-token conversation serialized
    once, so a request costs the client one copy of its body, not a JSON encode of 100k tokens."""

    def __init__(self) -> None:
        body = orjson.loads(large_request(stream=False))
        messages = orjson.dumps(body["messages"])
        self.head = b'{"model":"stub-model","max_tokens":16,"messages":' + messages[:-1]
        self.tails: dict[str, list[bytes]] = {}

    def next_body(self, session: str) -> bytes:
        """The session's next turn: everything so far plus a new user message."""
        tail = self.tails.setdefault(session, [])
        turn = (len(tail) + 1) // 2
        tail.append(orjson.dumps({"role": "user", "content": f"{session} turn {turn}: next step"}))
        return b"".join([self.head, b",", b",".join(tail), b"]}"])

    def answered(self, session: str) -> None:
        self.tails[session].append(b'{"role":"assistant","content":"done."}')


async def _turn(
    clients: dict[str, aiohttp.ClientSession], url: str, talks: Conversations, session: str
) -> tuple[bool, float, float]:
    """The session's next turn, answered: whether it succeeded, and when it started and ended."""
    body = talks.next_body(session)
    start = time.monotonic()
    try:
        async with clients[session].post(
            url + "/v1/chat/completions", data=body, headers={**HEADERS, "x-session-id": session}
        ) as answer:
            await answer.read()
            ok = answer.status == 200
    except (aiohttp.ClientError, TimeoutError):
        ok = False
    talks.answered(session)
    return ok, start, time.monotonic()


def _figures(latencies: list[float], errors: int, seconds: float) -> dict[str, Any]:
    return {
        "requests": len(latencies),
        "req_per_s": len(latencies) / seconds,
        "p50_s": median(latencies) if latencies else None,
        "p99_s": percentile(latencies, 99) if latencies else None,
        "errors": errors,
    }


async def _first_turns(
    clients: dict[str, aiohttp.ClientSession], url: str, sessions: list[str], talks: Conversations
) -> dict[str, Any]:
    began = time.monotonic()
    turns = asyncio.gather(*(_turn(clients, url, talks, s) for s in sessions))
    answered = await asyncio.wait_for(turns, FIRST_TURNS_TIMEOUT_S)
    took = time.monotonic() - began
    latencies = [end - start for ok, start, end in answered if ok]
    return {"seconds": took, **_figures(latencies, len(answered) - len(latencies), took)}


async def _steady(
    clients: dict[str, aiohttp.ClientSession],
    url: str,
    sessions: list[str],
    talks: Conversations,
    seconds: float,
    meter: CpuMeter,
) -> dict[str, Any]:
    async def warm(session: str) -> None:
        for _ in range(WARMUP_TURNS):
            await _turn(clients, url, talks, session)

    # A first turn is answered before it is tokenized whole (routed on its head, the rest lands
    # beside it), and a session's next turn waits for that landing: the window opens once every
    # session has its previous turn at hand, so it counts returning turns only.
    began = time.monotonic()
    await asyncio.gather(*(warm(s) for s in sessions))
    warmed = time.monotonic() - began
    closes = time.monotonic() + seconds
    latencies: list[float] = []
    errors = 0

    async def loop(session: str) -> None:
        nonlocal errors
        while time.monotonic() < closes:
            ok, start, end = await _turn(clients, url, talks, session)
            if end <= closes:
                if ok:
                    latencies.append(end - start)
                else:
                    errors += 1

    before = meter.read()
    await asyncio.gather(*(loop(s) for s in sessions))
    window = meter.since(before)  # the last turns end just after ``closes``: charged, not counted
    return {
        "warmup_s": warmed,
        **_figures(latencies, errors, seconds),
        "cpu_s": window,
        "cpu_window_s": seconds,
    }


class CpuMeter:
    """CPU seconds used by the proxy's processes (workers and supervisor), its Redis and this client."""

    def __init__(self, proxy_pid: int, probe: redis.Redis | None) -> None:
        self.root = psutil.Process(proxy_pid)
        self.client = psutil.Process(os.getpid())
        # a Redis the bench started (one process on --redis-url) is no child of the proxy
        self.redis = None if probe is None else psutil.Process(int(probe.info("server")["process_id"]))

    def _processes(self) -> list[psutil.Process]:
        found = [self.root, *self.root.children(recursive=True)]
        return found if self.redis is None or self.redis in found else [*found, self.redis]

    def read(self) -> dict[str, float]:
        out = {"proxy": 0.0, "redis": 0.0, "client": 0.0}
        for proc in self._processes():
            try:
                used = cpu_seconds(proc)
                part = "redis" if proc == self.redis or "redis" in proc.name() else "proxy"
            except psutil.Error:  # a process that ended between the listing and the read
                continue
            out[part] += used
            if part == "proxy":
                out[f"pid {proc.pid}"] = used
        out["client"] = cpu_seconds(self.client)
        return out

    def since(self, before: dict[str, float]) -> dict[str, float]:
        now = self.read()
        return {k: v - before.get(k, 0.0) for k, v in now.items()}


def _redis_probe(supervisor: psutil.Process, url: str | None) -> redis.Redis | None:
    """A client of the Redis the proxy shares its state through: ``url``, else the embedded server
    the supervisor started (its child listening on ``redis.sock``), else None (memory state)."""
    if url is not None:
        return redis.Redis.from_url(url)
    for child in supervisor.children(recursive=True):
        for conn in child.net_connections(kind="unix"):
            if conn.laddr and conn.laddr.endswith("redis.sock"):
                return redis.Redis(unix_socket_path=conn.laddr)
    return None


def _commands(probe: redis.Redis | None) -> int | None:
    """Commands that Redis processed so far (its own INFO), or None without one."""
    return None if probe is None else int(probe.info("stats")["total_commands_processed"])


async def _load(
    url: str, meter: CpuMeter, concurrency: int, seconds: float, shared_pool: bool
) -> dict[str, Any]:
    talks = Conversations()
    sessions = [f"s{i}" for i in range(concurrency)]
    timeout = aiohttp.ClientTimeout(total=FIRST_TURNS_TIMEOUT_S)
    # One pool per session, as each agent process has its own: a session's turns reuse its own
    # keep-alive connection. ``shared_pool``: one pool for all, so any turn may take any connection.
    pools = [
        aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=1))
        for _ in range(1 if shared_pool else concurrency)
    ]
    if shared_pool:
        pools[0] = aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=concurrency))
    clients = {s: pools[0 if shared_pool else i] for i, s in enumerate(sessions)}
    try:
        first = await _first_turns(clients, url, sessions, talks)
        steady = await _steady(clients, url, sessions, talks, seconds, meter)
    finally:
        for pool in pools:
            await pool.close()
    return {"first_turns": first, "steady": steady}


def _wait_for_listeners(supervisor: psutil.Process, url: str, workers: int) -> None:
    """Wait until every worker listens: the supervisor answers ``/health`` once its first worker
    does, and keep-alive clients that connect before the others listen all stay with that one."""
    port = int(url.rsplit(":", 1)[1])
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        listening = {
            proc.pid
            for proc in supervisor.children(recursive=True)
            for conn in proc.net_connections(kind="tcp")
            if conn.status == psutil.CONN_LISTEN and conn.laddr.port == port
        }
        if len(listening) >= workers:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{workers} workers did not all listen within 60 s")


def run(
    workers: int,
    ranks: list[str],
    concurrency: int,
    seconds: float,
    session_memory_mb: float = SESSION_MEMORY_MB,
    *,
    redis_url: str | None = None,
    shared_pool: bool = False,
    root: Path | None = None,
) -> dict[str, Any]:
    """One configuration: ``workers`` processes (their embedded Redis past one), or one process on
    ``redis_url`` (the bench's own server); ``root``: prefixgate from that source tree."""
    config = embedded_tokenizer_config()
    extra = ["--config", str(config), "--session-memory-mb", str(session_memory_mb)]
    extra += ["--workers", str(workers)] if workers > 1 else []
    if redis_url is not None:
        extra += ["--redis-url", redis_url]
    proxy, url = proxy_process(ranks, extra=extra, root=root)
    try:
        with proxy:
            supervisor = psutil.Process(proxy.pid)
            if workers > 1:
                _wait_for_listeners(supervisor, url, workers)
            probe = _redis_probe(supervisor, redis_url)
            before = _commands(probe)
            result = asyncio.run(_load(url, CpuMeter(proxy.pid, probe), concurrency, seconds, shared_pool))
            after = _commands(probe)
    finally:
        config.unlink()
    steady = result["steady"]
    done = steady["requests"]
    cpu = steady["cpu_s"]
    if done:
        steady["proxy_cpu_ms_per_request"] = 1000 * cpu["proxy"] / done
        steady["redis_cpu_ms_per_request"] = 1000 * cpu["redis"] / done
        steady["client_cpu_share"] = cpu["client"] / seconds
    # Redis's counters span both phases, warm-up included: an estimate per request sent
    sent = int(result["first_turns"]["requests"] + steady["requests"])
    if before is not None and after is not None and sent:
        result["redis_commands_per_request"] = (after - before) / sent
    return result


def _print(results: dict[str, Any], cores: int) -> None:
    base = results["1 (memory)"]["steady"]["req_per_s"] or 1.0
    print(f"cores: {cores}")
    print(
        f"{'configuration':<14}{'1st turns s':>12}{'req/s':>8}{'x one':>7}{'p50 s':>8}{'p99 s':>8}"
        f"{'errors':>7}{'cpu ms/req':>11}{'req/s/core':>11}{'redis ms':>9}{'client':>7}{'cmd/req':>8}"
    )
    for name, r in results.items():
        first, steady = r["first_turns"], r["steady"]
        cpu = steady.get("proxy_cpu_ms_per_request")
        cmds = r.get("redis_commands_per_request")
        print(
            f"{name:<14}{first['seconds']:>12.1f}"
            f"{steady['req_per_s']:>8.1f}{steady['req_per_s'] / base:>7.2f}"
            f"{(steady['p50_s'] or 0):>8.3f}{(steady['p99_s'] or 0):>8.3f}"
            f"{first['errors'] + steady['errors']:>7}"
            f"{'' if cpu is None else f'{cpu:.2f}':>11}{'' if not cpu else f'{1000 / cpu:.0f}':>11}"
            f"{steady.get('redis_cpu_ms_per_request', 0):>9.2f}{steady.get('client_cpu_share', 0):>7.0%}"
            f"{'' if cmds is None else f'{cmds:.1f}':>8}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="2,4", help="worker counts to run beside one process")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--seconds", type=positive_seconds, default=20.0, help="the steady window")
    parser.add_argument("--ranks", type=int, default=2, help="stub ranks (own processes)")
    parser.add_argument(
        "--shared-pool",
        action="store_true",
        help="one client connection pool for every session (any turn on any connection, so on any "
        "worker), instead of one keep-alive connection per session as agents have",
    )
    parser.add_argument(
        "--session-memory-mb",
        type=float,
        default=SESSION_MEMORY_MB,
        help="each process's --session-memory-mb (prefixgate's own default is 512)",
    )
    parser.add_argument("--proxy-root", help="also run every configuration from this source tree, in turn")
    args = parser.parse_args()
    load = (args.concurrency, args.seconds, args.session_memory_mb)
    stubs = [stub_rank_process() for _ in range(args.ranks)]
    for stub, _ in stubs:
        stub.__enter__()
    try:
        specs = [f"stub{i}={url}" for i, (_, url) in enumerate(stubs)]
        trees: list[tuple[str, Path | None]] = [("", None)]
        if args.proxy_root:
            trees.append((" (root)", Path(args.proxy_root).resolve()))
        counts = [int(w) for w in args.workers.split(",") if w]
        results: dict[str, Any] = {}
        for label, root in trees:  # each configuration from every tree in turn, side by side
            results["1 (memory)" + label] = run(1, specs, *load, shared_pool=args.shared_pool, root=root)
        for label, root in trees:
            # a Redis of its own each: the next tree's first turns found the chains the previous
            # one wrote, and landed twice as fast (2.4 against 4.8 s, whichever tree went second)
            with redis_server() as redis_url:
                results["1 (redis)" + label] = run(
                    1, specs, *load, redis_url=redis_url, shared_pool=args.shared_pool, root=root
                )
        for n in counts:
            for label, root in trees:
                results[f"{n} workers" + label] = run(
                    n, specs, *load, shared_pool=args.shared_pool, root=root
                )
    finally:
        for stub, _ in stubs:
            stub.__exit__(None, None, None)
    cores = os.cpu_count() or 1
    _print(results, cores)
    path = write_json(
        "workers.json",
        {
            "machine": machine(),
            "cores": cores,
            "concurrency": args.concurrency,
            "seconds": args.seconds,
            "results": results,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
