"""What one admission decision costs in CPU with many active sessions: the count and the cost options.

Admission decides a new session's place on a fresh count of every active session (``Ledger.refresh``,
``accounting.count``) and the ``cost`` policy's options over each rank's sessions
(``Admission._options``): both are O(active sessions), on the event loop, for every new session and
every attempt of a waiting one (``bench.load``'s 1,000 sessions arriving together spent a third of
the proxy's CPU there). Each tree given builds the same table (``--sessions`` active sessions of one
agent on ``--ranks`` ranks, with learned clocks and growth) in its own child process and times,
median per call: ``refresh`` (what an attempt runs), ``count`` (the read alone) and ``options``.
Trees run in turn, ``--rounds`` times alternating; ``--root DIR`` adds a tree (another checkout)::

    python -m bench.admission_count [--root ../base] [--sessions 100,1000] [--rounds 3]

Writes ``bench/out/admission_count.json``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.common import machine, median, run_in_tree, write_json

#: The measurement, run in a child process with the tree's own modules first on the path.
CHILD = """
import json, random, sys, time
sys.path.insert(0, sys.argv[1])
from proxy.admission import Admission, AdmissionConfig
from proxy.state.memory import MemorySessionStore
from proxy.state.sessions import Session, SessionTable
from routing.ranks import Fleet, Rank
sessions, ranks, calls = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
now = 10_000.0
table = SessionTable(MemorySessionStore(), idle_ttl=300.0, clock=lambda: now)
fleet = Fleet(Rank(f"r{i}", f"http://127.0.0.1:{9000 + i}", pool_tokens=sessions * 40_000, block_size=16)
              for i in range(ranks))
admission = Admission(table, fleet, AdmissionConfig(block_size=16, policy="cost"))
draw = random.Random(7)
for n in range(sessions):
    seen = now - draw.random() * 60
    session = Session(f"s{n}", created=seen - 600, last_seen=seen, rank=f"r{n % ranks}", turns=4,
                      context_tokens=draw.randint(2_000, 60_000), head_key="agent", head_tokens=1_500)
    session.answered_at, session.gaps, session.gap_last, session.gap_max = seen, 3, 4.0, 9.0
    table.save(session)
for n in range(200):  # learned clocks: think gaps, ended sessions, request durations
    admission.time.note_gap(draw.uniform(1.0, 30.0))
    admission.time.note_duration(draw.uniform(0.5, 5.0))
    admission.peaks.add(draw.randint(20_000, 90_000))
    if n % 3 == 0:
        admission.time.note_end(draw.randint(2, 40), draw.uniform(60.0, 3_000.0))
    else:
        admission.time.note_returns(1)
admission.refresh()
def timed(fn):
    out = []
    for _ in range(calls):
        started = time.perf_counter()
        fn()
        out.append(time.perf_counter() - started)
    return out
states = admission.count()
options = lambda: admission._options(states, 30_000, 40_000, "agent", 1_500, {})
print(json.dumps({"refresh": timed(admission.refresh), "count": timed(admission.count),
                  "options": timed(options)}))
"""

MEASURES = ("refresh", "count", "options")


def run_tree(root: Path, sessions: int, ranks: int, calls: int) -> dict[str, list[float]]:
    data: dict[str, list[float]] = run_in_tree(CHILD, root, sessions, ranks, calls)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", action="append", default=[], help="another tree to measure beside this one")
    parser.add_argument("--sessions", default="100,1000", help="active sessions, comma-separated")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200, help="timed calls of each measure per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs per tree, alternating")
    args = parser.parse_args()
    trees = [Path(__file__).resolve().parent.parent, *(Path(r).resolve() for r in args.root)]
    results: dict[str, dict[str, Any]] = {}
    print(f"{'tree':32} {'sessions':>8}" + "".join(f"{m + ' p50 us':>16}" for m in MEASURES))
    for sessions in (int(s) for s in args.sessions.split(",")):
        rounds: dict[Path, dict[str, list[float]]] = {tree: {m: [] for m in MEASURES} for tree in trees}
        for _ in range(args.rounds):
            for tree in trees:
                data = run_tree(tree, sessions, args.ranks, args.calls)
                for measure in MEASURES:
                    rounds[tree][measure].append(median(data[measure]) * 1e6)
        for tree, per_measure in rounds.items():
            row = {m: median(values) for m, values in per_measure.items()}
            results[f"{tree} ({sessions})"] = {
                "tree": str(tree),
                "sessions": sessions,
                "ranks": args.ranks,
                "p50_us": row,
                "rounds_us": per_measure,
            }
            print(f"{str(tree)[-32:]:32} {sessions:>8}" + "".join(f"{row[m]:>16.0f}" for m in MEASURES))
    write_json("admission_count.json", {"machine": machine(), "calls": args.calls, "results": results})


if __name__ == "__main__":
    main()
