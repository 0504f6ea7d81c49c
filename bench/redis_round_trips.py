"""Redis round trips per request of a whole prefixgate replica, on the request's path and off it.

One prefixgate (in this process) with ``--redis-url`` in front of ``--ranks`` simulated ranks (no
model time) serves ``--sessions`` conversations of ``--turns`` turns, one request at a time, each
growing by a user message and the answer. Every round trip the process makes to Redis is counted
client-side (one per command sent, one per pipeline) and split by thread: the event loop's are on
the request's path, the Redis link's thread's are the background writes. Figures per request, for a
session's first request (new: placed, bound, its room reserved) and for its later turns, plus the
commands Redis ran (its ``INFO commandstats``: those inside scripts included). ``--root DIR``
imports prefixgate from another checkout, to measure two trees side by side::

    python -m bench.redis_round_trips [--root ../base] [--sessions 40] [--turns 6]

Writes ``bench/out/redis_round_trips[-LABEL].json``. Counts, not times: no clock is involved.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any


def _commands(client: Any) -> int:
    return int(sum(v["calls"] for v in client.info("commandstats").values()))


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.root:
        sys.path.insert(0, str(Path(args.root).resolve()))
    import httpx
    import redis
    import redis.connection

    from bench.sim import SimConfig, start_fleet, stop_fleet
    from proxy.app import create_app
    from proxy.config import load_settings
    from proxy.server import ServerThread
    from proxy.state.embedded_redis import EmbeddedRedis

    sent: Counter[str] = Counter()
    by_command: Counter[tuple[str, str]] = Counter()
    original = redis.connection.AbstractConnection.send_packed_command

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        thread = threading.current_thread().name
        sent[thread] += 1
        if args.by_command:
            packet = b"".join(command) if isinstance(command, list) else command
            parts = packet.split(b"\r\n")
            what = parts[2].decode() if len(parts) > 2 else "?"
            if what.upper() == "EVALSHA" and len(parts) > 4:
                what += ":" + parts[4][:8].decode()
            by_command[(thread.split("-")[0], what)] += 1
        original(self, command, check_health)

    server = EmbeddedRedis().start()  # a private redis-server on a unix socket
    url = server.url
    probe = redis.Redis.from_url(url)
    fleet = start_fleet(args.ranks, SimConfig(time_scale=0, kv_tokens=args.pool_tokens))
    gateway: ServerThread | None = None
    try:
        flags = {"redis_url": url, "log_level": "warning", "session_idle_ttl": 600.0}
        specs = [f"{s.config.name}={s.url}" for s in fleet]
        gateway = ServerThread(
            create_app(load_settings(flags=flags, backend_specs=specs, environ={}))
        ).start()
        setattr(redis.connection.AbstractConnection, "send_packed_command", counting)  # noqa: B010
        phases: dict[str, dict[str, float]] = {}
        system = {"role": "system", "content": "You are a careful agent. " * 400}
        histories = {s: [dict(system)] for s in range(args.sessions)}
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            for turn in range(args.turns):
                phase = "first" if turn == 0 else "later"
                before, commands = Counter(sent), _commands(probe)
                for s, history in histories.items():
                    history.append({"role": "user", "content": f"session {s} step {turn}: " + "go on " * 50})
                    body = {"model": "sim", "messages": history, "max_tokens": 16}
                    answer = client.post("/v1/chat/completions", json=body, headers={"x-session-id": f"s{s}"})
                    answer.raise_for_status()
                    history.append(answer.json()["choices"][0]["message"])
                time.sleep(0.5)  # the link's thread drains its writes
                delta = Counter(sent)
                delta.subtract(before)
                loop = sum(n for name, n in delta.items() if name.startswith("uvicorn-"))  # the event loop
                total = sum(n for name, n in delta.items() if name != "MainThread")  # not this script's INFO
                stats = phases.setdefault(phase, {"requests": 0, "path": 0, "background": 0, "commands": 0})
                stats["requests"] += args.sessions
                stats["path"] += loop
                stats["background"] += total - loop
                stats["commands"] += _commands(probe) - commands - 1  # minus this INFO itself
    finally:
        if gateway is not None:  # a failed request must not leave the gateway's thread running
            gateway.stop()
        setattr(redis.connection.AbstractConnection, "send_packed_command", original)  # noqa: B010
        stop_fleet(fleet)
        probe.close()
        server.stop()
    out: dict[str, Any] = {"sessions": args.sessions, "turns": args.turns, "threads": sorted(sent)}
    if args.by_command:
        out["by_command"] = {f"{t} {c}": n for (t, c), n in by_command.most_common()}
    for phase, stats in phases.items():
        n = stats["requests"]
        out[phase] = {
            "requests": int(n),
            "path_round_trips_per_request": stats["path"] / n,
            "background_round_trips_per_request": stats["background"] / n,
            "redis_commands_per_request": stats["commands"] / n,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", help="import prefixgate from this checkout instead")
    parser.add_argument("--label", default="", help="suffix of the JSON file's name")
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--pool-tokens", type=int, default=400_000)
    parser.add_argument("--by-command", action="store_true", help="also count round trips per command")
    args = parser.parse_args()
    result = run(args)
    print(f"threads that reached Redis: {', '.join(result['threads'])}")
    for what, n in result.get("by_command", {}).items():
        print(f"  {what}: {n}")
    print(f"{'requests':<16}{'n':>6}{'path RT/req':>14}{'background RT/req':>20}{'commands/req':>15}")
    for phase in ("first", "later"):
        r = result.get(phase)
        if r:
            print(
                f"{phase + ' turns':<16}{r['requests']:>6}{r['path_round_trips_per_request']:>14.2f}"
                f"{r['background_round_trips_per_request']:>20.2f}{r['redis_commands_per_request']:>15.2f}"
            )
    from bench.common import write_json

    name = f"redis_round_trips{'-' + args.label if args.label else ''}.json"
    print(f"wrote {write_json(name, result)}")


if __name__ == "__main__":
    main()
