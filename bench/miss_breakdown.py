"""Where a trace replay lost prefix-cache hits against the infinite-cache bound, request by request.

Reads a ``prefixgate bench`` ``results.json`` (each request's prompt, cached and bound tokens and the
rank that served it) and, optionally, the log of the prefixgate process that served it, run with
``--log-level info`` (``bench/out/bench/logs/prefixgate_<policy>.log``): the router logs every
session that leaves its rank and why, admission every session it releases. Each request's loss is
``bound hit tokens - cached tokens`` (the bound: one rank with an unlimited pool), charged to one cause:

- ``first turn``: the session's first request (the bound may hit other sessions' shared head).
- ``moved: <why>``: served by another rank than the session's previous request; why, from the log:
  ``saturated`` / ``over the load bound`` (the policy), ``re-homed off an over-full rank``,
  ``admitted anew after a release`` / ``after idling out`` (admission), ``rank down or failed``;
  ``unknown`` without a log.
- ``same rank, after a release``: admission released the session and it came back to the same rank.
- ``same rank, evicted``: same rank, fewer hits than the bound: the rank evicted its blocks.

Usage::

    python -m bench.miss_breakdown bench/out/bench/results.json \\
        --log bench/out/bench/logs/prefixgate_prefix_affinity.log --scenario over

Prints a table and writes ``bench/out/miss_breakdown.json`` (``--out``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import OUT_DIR

_MOVED = re.compile(r"session (\S+) turn (\d+) moved (\S+) -> (\S+): (.*)$")
_RELEASED = re.compile(r"session (\S+) released before its turn (\d+) on (\S+)")
_REHOMED = re.compile(r"session (\S+) re-homed before its turn (\d+)")


@dataclass
class Cause:
    requests: int = 0
    lost_tokens: int = 0


@dataclass
class Breakdown:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    bound_tokens: int = 0
    #: Tokens the ranks hit beyond the bound (possible only through rounding; reported, not netted).
    above_bound_tokens: int = 0
    causes: dict[str, Cause] = field(default_factory=lambda: defaultdict(Cause))

    @property
    def lost_tokens(self) -> int:
        return sum(c.lost_tokens for c in self.causes.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "bound_hit_tokens": self.bound_tokens,
            "hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "bound": self.bound_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "lost_tokens": self.lost_tokens,
            "above_bound_tokens": self.above_bound_tokens,
            "causes": {
                name: {"requests": c.requests, "lost_tokens": c.lost_tokens}
                for name, c in sorted(self.causes.items(), key=lambda kv: -kv[1].lost_tokens)
            },
        }


@dataclass(frozen=True, slots=True)
class LogEvents:
    """From the proxy's log: why a session's turn moved, and the turns that followed a release."""

    moves: Mapping[tuple[str, int], str]
    releases: AbstractSet[tuple[str, int]]
    rehomes: AbstractSet[tuple[str, int]] = frozenset()


def read_log(path: Path) -> LogEvents:
    moves: dict[tuple[str, int], str] = {}
    releases: set[tuple[str, int]] = set()
    rehomes: set[tuple[str, int]] = set()
    for line in path.read_text(errors="replace").splitlines():
        if m := _MOVED.search(line):
            moves[(m[1], int(m[2]))] = m[5]
        elif m := _RELEASED.search(line):
            releases.add((m[1], int(m[2])))
        elif m := _REHOMED.search(line):
            rehomes.add((m[1], int(m[2])))
    return LogEvents(moves, releases, rehomes)


def move_cause(reason: str | None, released: bool) -> str:
    if reason is None:
        return "moved: unknown (no log line)"
    if reason.startswith("admitted anew"):
        return "moved: admitted anew after a release" if released else "moved: admitted anew after idling out"
    if reason.startswith("saturated"):
        return "moved: saturated"
    if reason.startswith("over the load bound"):
        return "moved: over the load bound"
    return "moved: rank down or failed"


def breakdown(turns: list[dict[str, Any]], events: LogEvents | None) -> Breakdown:
    """Charge each request's loss against the bound to one cause (see the module docstring)."""
    out = Breakdown()
    previous: dict[str, str] = {}
    for t in sorted(turns, key=lambda t: (t["session"], t["turn"])):
        session, turn = t["session"], t["turn"]
        out.prompt_tokens += t["prompt_tokens"]
        out.cached_tokens += t["cached_tokens"]
        out.bound_tokens += t["bound_hit_tokens"]
        lost = t["bound_hit_tokens"] - t["cached_tokens"]
        if lost < 0:
            out.above_bound_tokens -= lost
            lost = 0
        released = events is not None and (session, turn) in events.releases
        before = previous.get(session)
        if before is None:
            cause = "first turn"
        elif before != t["backend"]:
            if events is None:
                cause = "moved: unknown (no log)"
            elif (session, turn) in events.rehomes:
                cause = "moved: re-homed off an over-full rank"
            else:
                cause = move_cause(events.moves.get((session, turn)), released)
        elif released:
            cause = "same rank, after a release"
        elif lost:
            cause = "same rank, evicted"
        else:
            cause = "same rank, hit as the bound"
        entry = out.causes[cause]
        entry.requests += 1
        entry.lost_tokens += lost
        previous[session] = t["backend"]
    return out


def print_table(title: str, result: Breakdown) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("cause", "requests", "tokens lost", "share of the loss"):
        table.add_column(column, justify="left" if column == "cause" else "right")
    lost = result.lost_tokens or 1
    for name, cause in sorted(result.causes.items(), key=lambda kv: -kv[1].lost_tokens):
        table.add_row(name, str(cause.requests), f"{cause.lost_tokens:,}", f"{cause.lost_tokens / lost:.1%}")
    console = Console(width=None if sys.stdout.isatty() else 120)
    console.print(table)
    d = result.to_dict()
    console.print(
        f"hit rate {d['hit_rate']:.4f}, bound {d['bound']:.4f}; prefill "
        f"{d['prompt_tokens'] - d['cached_tokens']:,} tokens, of which {d['lost_tokens']:,} lost against "
        f"the bound ({d['above_bound_tokens']:,} hit beyond it)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("results", type=Path, help="results.json of prefixgate bench")
    parser.add_argument(
        "--log", type=Path, default=None, help="the prefixgate process's log (--log-level info)"
    )
    parser.add_argument("--scenario", default="over")
    parser.add_argument("--system", default="prefixgate prefix_affinity", help="a system of the results")
    parser.add_argument("--out", type=Path, default=OUT_DIR / "miss_breakdown.json")
    args = parser.parse_args(argv)
    report = json.loads(args.results.read_text())
    scenarios = report["scenarios"]
    if args.scenario not in scenarios:
        parser.error(f"--scenario {args.scenario!r}: the results hold {', '.join(map(repr, scenarios))}")
    results = scenarios[args.scenario]["results"]
    if args.system not in results:
        # a system run with extra serve flags is named after them too ("prefixgate prefix_affinity --x")
        named = [name for name in results if name.startswith(args.system + " ")]
        if len(named) != 1:
            parser.error(f"--system {args.system!r}: the results hold {', '.join(map(repr, results))}")
        args.system = named[0]
    result = results[args.system]
    events = read_log(args.log) if args.log is not None else None
    found = breakdown(result["turns"], events)
    print_table(f"{args.system}, scenario {args.scenario}: hits lost against the bound", found)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "results": str(args.results),
        "log": str(args.log) if args.log else None,
        "scenario": args.scenario,
        "system": args.system,
        "git_head": report.get("git_head"),
        "prefixgate_args": report.get("prefixgate_args"),
        **found.to_dict(),
    }
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
