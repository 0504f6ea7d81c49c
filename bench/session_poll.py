"""What admission's poll of the active sessions costs with Redis: ``seen_since`` on a table of
``--sessions`` active records, ``--changed`` of them written by another replica between polls.

Admission polls every 10-250 ms (``Ledger.refresh``) on the event loop. Each tree given runs the same
polls against its own embedded Redis, in turn, ``--rounds`` times alternating; printed per tree: the
poll's client CPU (``time.process_time``, median per poll) and records returned. ``--root DIR``
adds a tree (another checkout) to measure beside this one::

    python -m bench.session_poll [--root ../base] [--sessions 256,1000] [--changed 8] [--polls 200]

Writes ``bench/out/session_poll.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.common import machine, median, run_in_tree, write_json

#: The measurement, run in a child process with the tree's own modules first on the path.
CHILD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
from proxy.state.embedded_redis import EmbeddedRedis
from proxy.state.redis import RedisSessionStore
from proxy.state.sessions import Session
sessions, changed, polls = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
server = EmbeddedRedis().start()
try:
    reader = RedisSessionStore(server.url, socket_timeout=2.0)
    writer = RedisSessionStore(server.url, socket_timeout=2.0)
    clock = 1000.0
    records = [Session(f"session-{n}", created=clock, last_seen=clock, rank="r0", turns=1,
                       context_tokens=50_000, admission={"decision": "admitted", "waited_s": 0.0})
               for n in range(sessions)]
    for record in records:
        writer.save(record)
    writer.link.flush()
    reader.seen_since(0.0)
    cpu = []
    for poll in range(polls):
        for n in range(changed):
            record = records[(poll * changed + n) % sessions]
            record.turns += 1
            clock += 0.001
            record.last_seen = clock
            writer.save(record)
        writer.link.flush()
        started = time.process_time()
        found = reader.seen_since(0.0)
        cpu.append(time.process_time() - started)
        assert len(found) == sessions, len(found)
    print(json.dumps({"cpu_s": cpu, "returned": len(found)}))
finally:
    server.stop()
"""


def run_tree(root: Path, sessions: int, changed: int, polls: int) -> dict[str, Any]:
    data: dict[str, Any] = run_in_tree(CHILD, root, sessions, changed, polls)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", action="append", default=[], help="another tree to measure beside this one")
    parser.add_argument("--sessions", default="256,1000", help="active records, comma-separated")
    parser.add_argument("--changed", type=int, default=8, help="records written between two polls")
    parser.add_argument("--polls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3, help="runs per tree, alternating")
    args = parser.parse_args()
    trees = [Path(__file__).resolve().parent.parent, *(Path(r).resolve() for r in args.root)]
    results: dict[str, dict[str, Any]] = {}
    print(f"{'tree':40} {'sessions':>8} {'changed':>8} {'poll cpu p50 us':>16} {'rounds':>24}")
    for sessions in (int(s) for s in args.sessions.split(",")):
        per_tree: dict[Path, list[float]] = {tree: [] for tree in trees}
        for _ in range(args.rounds):
            for tree in trees:
                data = run_tree(tree, sessions, args.changed, args.polls)
                per_tree[tree].append(median(data["cpu_s"]) * 1e6)
        for tree, rounds in per_tree.items():
            label = f"{tree} ({sessions})"
            results[label] = {
                "tree": str(tree),
                "sessions": sessions,
                "changed": args.changed,
                "poll_cpu_us_rounds": rounds,
                "poll_cpu_us": median(rounds),
            }
            shown = ", ".join(f"{r:.0f}" for r in rounds)
            print(f"{str(tree)[-40:]:40} {sessions:>8} {args.changed:>8} {median(rounds):>16.0f} {shown:>24}")
    write_json("session_poll.json", {"machine": machine(), "polls": args.polls, "results": results})


if __name__ == "__main__":
    main()
