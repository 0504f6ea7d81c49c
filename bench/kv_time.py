"""The least completion time any system needs for a hit rate, from a ``prefixgate bench`` run's turns.

A turn hits its cached tokens only if they stayed in the pool through the think gap before it (the
client's send minus the previous answer's end, the least any system of the cell showed for that
turn). Over the turns that hit, their private tokens (past the shared system prompt: the median hit
a first turn could have) times that gap, shortest gaps first, are the pool-seconds a hit rate needs;
divided by the pool less the shared prompt, they bound the completion time from below. The running
turns' own KV is left out, so the bound is low: a system above it by far is held back by something
other than the pool (docs/investigations.md, "The seats trade at a tenth of the compression").

    python -m bench.kv_time bench/out/bench/results.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

#: The hit rate over the best peer's that issue 45 asks of prefixgate.
HIT_MARGIN = 0.15


def turn_gaps(results: dict[str, Any]) -> tuple[dict[tuple[str, int], float], dict[tuple[str, int], int]]:
    """Per (session, turn index): the least think gap any system showed before it (none for a first
    turn), and the tokens it could hit (its infinite-cache bound's)."""
    gaps: dict[tuple[str, int], float] = {}
    hits: dict[tuple[str, int], int] = {}
    for summary in results.values():
        sessions: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for turn in summary.get("turns", ()):
            sessions[turn["session"]].append(turn)
        for key, turns in sessions.items():
            turns.sort(key=lambda t: t["sent_s"])
            for i, turn in enumerate(turns):
                hits[(key, i)] = turn["bound_hit_tokens"]
                if i:
                    gap = max(turn["sent_s"] - turns[i - 1]["sent_s"] - turns[i - 1]["latency_s"], 0.0)
                    gaps[(key, i)] = min(gap, gaps.get((key, i), gap))
    return gaps, hits


def completion_bound(cell: dict[str, Any], hit_rate: float) -> float | None:
    """Seconds any system needs at least to reach ``hit_rate`` on ``cell`` (None: past the
    infinite-cache bound, which no system reaches)."""
    return _bound(*_space(cell), hit_rate)


def _space(cell: dict[str, Any]) -> tuple[list[tuple[float, float]], float, float, float]:
    """What the bound reads of a cell, the same for every hit rate asked: each later turn's gap and
    private tokens (shortest gaps first), the tokens a cache of shared heads alone hits, the prompt
    tokens, and the pool less the shared head."""
    gaps, hits = turn_gaps(cell["results"])
    turns = next(iter(cell["results"].values()))["turns"]
    prompt = sum(t["prompt_tokens"] for t in turns)
    shared = statistics.median(hits[key] for key in hits if key[1] == 0)
    pool = cell["kv_tokens"] * cell["ranks"]
    private = sorted((gaps[key], hits[key] - min(hits[key], shared)) for key in gaps)
    return private, sum(min(h, shared) for h in hits.values()), prompt, pool - shared


def _bound(
    private: list[tuple[float, float]], head_hits: float, prompt: float, room: float, hit_rate: float
) -> float | None:
    needed = hit_rate * prompt - head_hits
    pool_seconds = 0.0
    for gap, tokens in private:
        if needed <= 0:
            break
        taken = min(tokens, needed)
        pool_seconds += taken * gap
        needed -= taken
    return None if needed > 0 else pool_seconds / room


def cell_bounds(cell: dict[str, Any]) -> dict[str, Any]:
    """The bound for the best peer's hit rate + ``HIT_MARGIN`` and for each system's own, beside the
    completion each took (a cell without a peer: each system's only)."""
    results = cell["results"]
    space = _space(cell)  # once per cell, not per hit rate
    peers = {name: r for name, r in results.items() if not name.startswith("prefixgate")}
    out: dict[str, Any] = {
        name: {
            "hit_rate": r["hit_rate"],
            "completion_s": r["wall_s"],
            "bound_s": _bound(*space, r["hit_rate"]),
        }
        for name, r in results.items()
    }
    if peers:
        target = max(r["hit_rate"] for r in peers.values()) + HIT_MARGIN
        out["best peer + margin"] = {"hit_rate": target, "bound_s": _bound(*space, target)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_time", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="a prefixgate bench results.json")
    args = parser.parse_args()
    report = {
        name: cell_bounds(cell) for name, cell in json.loads(args.results.read_text())["scenarios"].items()
    }
    for name, bounds in report.items():
        print(name)
        for system, b in bounds.items():
            took = f", took {b['completion_s']:.1f} s" if "completion_s" in b else ""
            bound = "past the bound" if b["bound_s"] is None else f"completion >= {b['bound_s']:.1f} s"
            print(f"  {system:<40} hit {b['hit_rate']:.3f}: {bound}{took}")
    out = args.results.with_name("kv_time.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
