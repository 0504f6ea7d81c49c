"""Replicas replaying one trace: one prefixgate against N behind HAProxy sharing one Redis.

The same Claude Code conversations (``../shared/traces/claude-code``: ``--conversations``, their
first ``--requests`` requests, ``--concurrency`` at a time) are replayed, streamed, against each
system in turn, each on a fresh fleet of 4 simulated ranks (``prefixgate sim``) whose pools make the
replay's mean working set ``--pressure`` x the fleet's pool (``bench.pressure``: estimated from the
schedule before any run, then measured during each):

- ``1 replica``: one ``prefixgate serve`` (memory state);
- ``N replicas``: ``--replicas`` ``prefixgate serve --redis-url`` processes on one Redis behind
  HAProxy dealing requests in turn, so a session's consecutive requests reach different replicas.
  ``--redis`` is the topology: ``server`` (a private ``redis-server``,
  ``proxy/state/embedded_redis.py``), ``cluster`` (three masters joined into a Redis Cluster) or
  ``sentinel`` (a master watched by Sentinel), each on loopback (``bench/redis_servers.py``).
With ``--kv-events`` the ranks publish KV events and every prefixgate subscribes to them (its index
exact, as in a deployment with ``--kv-events``); without, the index predicts what each rank holds.

Per system, from the ranks' own usage: hit rate, prefill tokens, TTFT p50/p99, completion time
p50, completed conversations, 429s and errors, and the conversations answered by more than one rank;
from the session table, the wait order (``bench/wait_order.py``: how often a later arrival took room
before an earlier waiter); from the replicas' logs, the moves off a session's rank by the rule that
made them (``bench/moves.py``); from Redis, the commands and scripts it ran per request.
Clocks: think times x ``--think-scale`` and the sim's model time x ``--time-scale``; prefixgate's
idle TTL and wait bound are learned from the traffic each replica sees (not configured), so they
follow the compressed replay. Each system's requests hit its own fresh fleet::

    python -m bench.replica_replay [--replicas 2] [--conversations 24] [--requests 8] [--pressure 1.25]
        [--stop-replica-at S] [--restart-redis-at S] [--rounds 1]
        [--lockstep] [--redis server|cluster|sentinel] [--kv-events]

Faults, in the N-replica run: ``--stop-replica-at`` sends one replica SIGTERM (a rolling restart or a
pod deletion: it drains what it serves and stops listening; HAProxy retries a refused connection on
another replica), ``--restart-redis-at`` restarts Redis, every key lost (``--redis server`` only).
The replay client retries a connection refused before any answer and 429/502/503/504, as the
openai SDK does; the table counts requests answered against requests sent. ``--lockstep`` sends one
request at a time in an order fixed by the trace (``bench/lockstep.py``), so that runs repeat and 1
against N replicas differ only by what the replicas do.

Writes ``bench/out/replica_replay.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import statistics
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import httpx
import redis as redis_client

from bench.balancer import haproxy_binary, haproxy_config
from bench.common import Subprocess, machine, median, metric_totals, proxy_process, write_json
from bench.lockstep import replay_lockstep
from bench.moves import moves
from bench.pressure import mean_working_set, pool_for
from bench.redis_servers import RedisClusterServers, RedisSentinelServers
from bench.replay import ReplayResult, TraceReplayConfig, replay_trace
from bench.systems import FleetConfig, SimFleetProcess
from bench.traces import TraceSession, load_claude_code
from bench.wait_order import wait_order
from proxy.server import free_port
from proxy.state.embedded_redis import EmbeddedRedis
from routing.redis_link import fail_fast_client
from routing.redis_topology import slot_prefix

RANKS = 4
#: How long a restarted Redis stays down.
REDIS_DOWN_S = 1.0
#: ``--redis``: the topology the replicas share, started fresh for each N-replica run.
TOPOLOGIES = ("server", "cluster", "sentinel")


def _replay(url: str, sessions: list[TraceSession], args: argparse.Namespace, model: str) -> ReplayResult:
    config = TraceReplayConfig(model, concurrency=args.concurrency, time_scale=args.think_scale)
    replay = replay_lockstep if args.lockstep else replay_trace
    return asyncio.run(replay(url, sessions, config))


def _faults(
    args: argparse.Namespace, replica: Subprocess, redis: EmbeddedRedis | None
) -> tuple[list[threading.Timer], list[str]]:
    """The faults ``--stop-replica-at`` and ``--restart-redis-at`` ask for, as timers started with the
    replay, and what each did (appended when it happens)."""
    done: list[str] = []
    timers = []
    if args.stop_replica_at is not None:

        def stop() -> None:
            assert replica.proc is not None
            replica.proc.send_signal(signal.SIGTERM)
            done.append(f"replica 0 sent SIGTERM at {args.stop_replica_at:g} s")

        timers.append(threading.Timer(args.stop_replica_at, stop))
    if args.restart_redis_at is not None and redis is not None:

        def restart() -> None:
            redis.restart(down_s=REDIS_DOWN_S)
            at = args.restart_redis_at
            done.append(f"Redis restarted at {at:g} s (down {REDIS_DOWN_S:g} s, data lost)")

        timers.append(threading.Timer(args.restart_redis_at, restart))
    return timers, done


def redis_commands(node_urls: list[str]) -> dict[str, int]:
    """Commands Redis ran in the replay, per command, summed over the topology's masters (``INFO
    commandstats``: those run inside scripts included; ``evalsha``: the scripts run, one round trip
    each unless pipelined). A restarted Redis counts from its restart."""
    calls: dict[str, int] = defaultdict(int)
    for url in node_urls:
        client = redis_client.Redis.from_url(url)
        try:
            stats = client.info("commandstats")
        finally:
            client.close()
        for name, v in stats.items():
            calls[name.removeprefix("cmdstat_")] += int(v["calls"])
    return dict(calls)


def superseded_saves(url: str) -> int:
    """Session saves Redis dropped because another replica had saved a later version of the
    record (a settlement landing after the next turn: that turn's usage counters are lost)."""
    client = fail_fast_client(url, 5.0)  # whatever the topology: the key's hash slot picks the node
    try:
        key = slot_prefix("prefixgate:sessions", client) + ":counters"
        return int(client.hget(key, "superseded") or 0)
    finally:
        client.close()


def start_redis(topology: str) -> EmbeddedRedis | RedisClusterServers | RedisSentinelServers:
    """A fresh Redis of ``topology`` (``TOPOLOGIES``), not yet started."""
    if topology == "cluster":
        return RedisClusterServers()
    if topology == "sentinel":
        return RedisSentinelServers()
    return EmbeddedRedis()


def node_urls(redis: EmbeddedRedis | RedisClusterServers | RedisSentinelServers) -> list[str]:
    """The plain URLs of the topology's masters, whose counters ``redis_commands`` sums."""
    return [redis.url] if isinstance(redis, EmbeddedRedis) else redis.node_urls


def _on(topology: str) -> str:
    return "" if topology == "server" else f" ({topology})"


def run_system(
    replicas: int, sessions: list[TraceSession], args: argparse.Namespace, kv_tokens: int
) -> dict[str, Any]:
    """One system on a fresh fleet: ``replicas`` = 1 (memory state), else that many on Redis behind
    HAProxy. Its row of figures."""
    fleet_config = FleetConfig(
        ranks=RANKS, kv_tokens=kv_tokens, time_scale=args.time_scale, kv_events=args.kv_events
    )
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(SimFleetProcess(fleet_config))
        specs = [f"sim-{i}={url}" for i, url in enumerate(fleet.urls)]
        redis = start_redis(args.redis) if replicas > 1 else None
        if redis is not None:
            stack.enter_context(redis)  # started: its __enter__ starts it
        flags = ["--redis-url", redis.url] if redis is not None else []
        flags += ["--log-level", "info"]  # moves and parks logged
        flags += ["--kv-events", "auto"] if args.kv_events else []
        urls, processes = [], []
        for _ in range(replicas):
            proxy, url = proxy_process(specs, extra=flags)
            processes.append(stack.enter_context(proxy))
            urls.append(url)
        if redis is not None:
            port = free_port()
            config = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "haproxy.cfg"
            config.write_text(haproxy_config(port, urls))
            url = f"http://127.0.0.1:{port}"
            stack.enter_context(Subprocess([haproxy_binary(), "-db", "-f", str(config)], url + "/health"))
            timers, faults = _faults(args, processes[0], redis if isinstance(redis, EmbeddedRedis) else None)
        else:
            url, timers, faults = urls[0], [], []
        for timer in timers:
            timer.start()
        result = _replay(url, sessions, args, fleet_config.model)
        for timer in timers:  # one that already fired finishes before the fleet is torn down
            timer.cancel()
            timer.join()
        order = wait_order(urls[-1])  # a live replica (the first may have been stopped)
        kv_events = _kv_event_totals(urls) if args.kv_events else {}
        moved = moves(p.log() for p in processes)
        commands = redis_commands(node_urls(redis)) if redis is not None else {}
        superseded = superseded_saves(redis.url) if redis is not None else 0
    summary = result.summary()
    ranks_of: dict[str, set[str]] = defaultdict(set)
    for turn in result.turns:
        ranks_of[turn.session].add(turn.rank)
    pool = RANKS * kv_tokens
    return {
        "system": "1 replica" if replicas == 1 else f"{replicas} replicas + HAProxy" + _on(args.redis),
        "replicas": replicas,
        "hit_rate": summary["hit_rate"],
        "prefill_tokens": summary["prefill_tokens"],
        "prompt_tokens": summary["prompt_tokens"],
        "ttft_p50_ms": summary["ttft_p50_ms"],
        "ttft_p99_ms": summary["ttft_p99_ms"],
        "completion_p50_ms": median([t.latency_s for t in result.turns]) * 1000,
        "requests": summary["requests"],
        "errors": summary["errors"],
        "refused_429": sum(1 for e in result.errors if "HTTP 429" in e),
        "error_samples": result.errors[:5],
        "completed_sessions": result.completed_sessions,
        "sessions_on_two_ranks": sum(1 for ranks in ranks_of.values() if len(ranks) > 1),
        "moves": moved,
        "sessions": len(ranks_of),
        "working_set_x_pool": statistics.fmean(result.working_set) / pool if result.working_set else 0.0,
        "wall_s": result.wall_s,
        "faults": faults,
        "wait_order": order,
        "redis_commands": commands,
        "session_saves_superseded": superseded,
        "kv_events": kv_events,
        "requests_sent": sum(len(s.requests) for top in sessions for s in top.all_sessions()),
        "turns": [turn.as_json() for turn in result.turns],  # in the order sent
    }


def _kv_event_totals(urls: list[str]) -> dict[str, float]:
    """KV events the replicas applied to their mirrors and the faults their feeds met, summed over
    the replicas still up (one may have been stopped)."""
    names = ("prefixgate_kv_events", "prefixgate_kv_event_faults")
    totals = dict.fromkeys(names, 0.0)
    for url in urls:
        with contextlib.suppress(httpx.HTTPError):
            for name, value in metric_totals(url, names).items():
                totals[name] += value
    return {"applied": totals[names[0]], "faults": totals[names[1]]}


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options (``argv``, else ``sys.argv``); exits with usage on a bad one."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="replicas behind HAProxy beside one")
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--requests", type=int, default=8, help="first requests kept per conversation")
    parser.add_argument(
        "--max-prompt", type=int, default=60_000, help="skip conversations with longer prompts"
    )
    parser.add_argument("--concurrency", type=int, default=16, help="conversations in flight at once")
    parser.add_argument("--think-scale", type=float, default=0.01, help="trace think times x this")
    parser.add_argument("--time-scale", type=float, default=0.2, help="the sim's model time x this")
    parser.add_argument("--pressure", type=float, default=1.25, help="mean working set / fleet pool")
    parser.add_argument(
        "--stop-replica-at", type=float, help="SIGTERM one replica this many seconds into the N-replica run"
    )
    parser.add_argument(
        "--restart-redis-at", type=float, help="restart Redis (its data lost) this many seconds into it"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of each system, alternated; medians printed too"
    )
    parser.add_argument(
        "--lockstep",
        action="store_true",
        help="one request at a time, in an order the trace alone fixes (bench/lockstep.py): runs repeat",
    )
    parser.add_argument(
        "--redis",
        choices=TOPOLOGIES,
        default="server",
        help="the Redis topology the replicas share (on loopback): one server, a three-master "
        "Cluster, or a master watched by Sentinel",
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="the ranks publish KV events and every prefixgate subscribes (--kv-events auto): the "
        "prefix index is then exact, not predicted",
    )
    args = parser.parse_args(argv)
    if args.restart_redis_at is not None and args.redis != "server":
        parser.error("--restart-redis-at restarts one server: use it with --redis server")
    return args


def main(argv: list[str] | None = None) -> int:
    args = arguments(argv)
    sessions = load_claude_code(
        max_prompt_tokens=args.max_prompt, limit=args.conversations, max_requests=args.requests
    )
    largest = max(s.max_input_tokens for top in sessions for s in top.all_sessions())
    estimate = mean_working_set(sessions, args.concurrency, args.think_scale)
    kv_tokens = max(pool_for(estimate, args.pressure, RANKS), int(largest * 1.05) // 16 * 16 + 16)
    print(
        f"{len(sessions)} Claude Code conversations (first {args.requests} requests), {args.concurrency} "
        f"at a time, {RANKS} ranks of {kv_tokens:,} tokens (estimated working set "
        f"{estimate / (RANKS * kv_tokens):.2f}x the fleet pool)",
        flush=True,
    )
    rows = []
    for n in range(args.rounds):  # alternated, so both systems see the machine's noise alike
        for replicas in (1, args.replicas):
            rows.append(run_system(replicas, sessions, args, kv_tokens))
            rows[-1]["round"] = n + 1
            print(f"  round {n + 1}: {rows[-1]['system']} done", flush=True)
    print(
        f"{'system':24} {'round':>5} {'hit rate':>9} {'prefill tok':>12} {'TTFT p50':>9} {'TTFT p99':>9} "
        f"{'done p50':>9} {'429':>4} {'err':>4} {'waited':>7} {'2 ranks':>8} {'WS/pool':>8}"
    )
    for r in rows:
        print(
            f"{r['system']:24} {r['round']:>5} {r['hit_rate']:>9.1%} {r['prefill_tokens']:>12,} "
            f"{r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms {r['completion_p50_ms']:>7.0f}ms "
            f"{r['refused_429']:>4} {r['errors']:>4} {r['wait_order']['waited']:>7} "
            f"{r['sessions_on_two_ranks']:>8} {r['working_set_x_pool']:>8.2f}"
        )
    if args.rounds > 1:
        for system in dict.fromkeys(r["system"] for r in rows):
            mine = [r for r in rows if r["system"] == system]
            print(
                f"{system + ' (median)':30} {median([r['hit_rate'] for r in mine]):>9.1%} "
                f"{'':>12} {median([r['ttft_p50_ms'] for r in mine]):>7.0f}ms "
                f"{median([r['ttft_p99_ms'] for r in mine]):>7.0f}ms "
                f"{median([r['completion_p50_ms'] for r in mine]):>7.0f}ms {'':>9} "
                f"{median([r['wait_order']['waited'] for r in mine]):>7g} "
                f"{median([r['sessions_on_two_ranks'] for r in mine]):>8g}"
            )
    for r in rows:
        for fault in r["faults"]:
            print(f"  {r['system']}: {fault}")
        lost = r["requests_sent"] - r["requests"]
        print(f"  {r['system']}: {r['requests']} of {r['requests_sent']} requests answered ({lost} lost)")
        commands = r["redis_commands"]
        if commands:
            per = r["requests"] or 1
            total, scripts = sum(commands.values()) / per, commands.get("evalsha", 0) / per
            print(
                f"  {r['system']}: Redis ran {total:.1f} commands per request answered, {scripts:.2f} "
                f"scripts, {commands.get('publish', 0) / per:.2f} publishes; "
                f"{r['session_saves_superseded']} session saves dropped for a later one (a turn's "
                "usage counters lost)"
            )
        order = r["wait_order"]
        print(
            f"  {r['system']}: wait order: {order['overtakes']} overtakes (a later arrival taking room "
            f"before an earlier waiter; bench/wait_order.py), {order['waited']} of "
            f"{order['admitted_sessions']} sessions waited"
        )
        kinds = ", ".join(
            f"{kind} {d['sessions']:g} ({d['waited']:g} waited {d['waited_s']:.1f} s)"
            for kind, d in sorted(order["decisions"].items())
        )
        print(f"  {r['system']}: latest admission decisions: {kinds}")
        rules = ", ".join(f"{rule} {d['moves']} ({d['sessions']} sessions)" for rule, d in r["moves"].items())
        print(f"  {r['system']}: moves off a session's rank, by rule (bench/moves.py): {rules or 'none'}")
    gaps = [rows[i + 1]["hit_rate"] - rows[i]["hit_rate"] for i in range(0, len(rows), 2)]
    gap = median(gaps)
    print(
        f"hit rate, {rows[1]['system']} minus 1 replica: {gap * 100:+.2f} points"
        + (f" (median of {', '.join(f'{g * 100:+.2f}' for g in gaps)})" if len(gaps) > 1 else "")
    )
    path = write_json(
        "replica_replay.json",
        {
            "config": vars(args),
            "kv_tokens_per_rank": kv_tokens,
            "machine": machine(),
            "runs": rows,
            "hit_rate_gap": gap,
        },
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
