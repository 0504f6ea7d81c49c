"""Soak: agent-like sessions with think gaps around 5 s and 60 s through prefixgate, for minutes.

Agents think between turns for a few seconds (a tool ran) or about a minute (a person read the
answer): the gaps that race keep-alive timers, the ranks' (uvicorn, 5 s) and prefixgate's own
against its clients' pools. Each session draws every gap from one of two bands, ``--short`` and
``--long`` seconds +/- 10 %, the long one with probability ``--long-share``; half the sessions use
httpx's default pool (idle connections expire after 5 s, as the openai SDK's), half a pool keeping
them 70 s (longer-lived clients). The target is 0 lost requests. Reported beside it: requests that
changed rank, latency p50/p99, the ranks' hit rate, 429s, and prefixgate's counters towards the
ranks (failures, retries, fresh-connection resends).

    python -m bench.soak [--minutes 3] [--sessions 40] [--short 5] [--long 60] [--long-share 0.3]

The default run takes about three minutes (a few long gaps per session); ``--minutes 30`` or more is
the real soak.

The run is real time: nothing is replayed or compressed, the timers raced are the wall clock's.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

from bench.common import machine, write_json
from bench.keepalive_sweep import (
    add_fleet_options,
    drive,
    outcome_line,
    proxy_flags,
    summarize,
    through_fleet,
)

#: The client pools' idle expiry, one per half of the sessions: httpx's default, and a long-lived one.
POOL_EXPIRIES = (5.0, 70.0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=3.0, help="how long sessions keep sending")
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--short", type=float, default=5.0, help="the short think gap, seconds")
    parser.add_argument("--long", type=float, default=60.0, help="the long think gap, seconds")
    parser.add_argument(
        "--long-share", type=float, default=0.3, help="share of gaps drawn from the long band"
    )
    parser.add_argument("--seed", type=int, default=0)
    add_fleet_options(parser)
    parser.set_defaults(prompt_kb=40)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)

    def gap_of(index: int, turn: int) -> float:
        band = args.long if rng.random() < args.long_share else args.short
        return band * rng.uniform(0.9, 1.1)

    def run(url: str) -> list[dict[str, Any]]:
        until = time.monotonic() + args.minutes * 60
        return asyncio.run(drive(url, args.sessions, 1 << 30, gap_of, args.prompt_kb, POOL_EXPIRIES, until))

    results, counters, elapsed = through_fleet(args, run)
    summary = summarize(results)
    # each request under the gap it followed (0 for a session's first turn)
    by_band = {
        band: sum(1 for r in results if "lost" in r and abs(r["gap"] - gap) <= gap * 0.11)
        for band, gap in (("first", 0.0), ("short", args.short), ("long", args.long))
    }
    summary["lost_by_gap_band"] = by_band
    summary.pop("by_gap")  # per distinct gap: every gap is distinct here
    summary["http_429"] = sum(1 for r in results if r.get("lost", "").startswith("HTTP 429"))
    report = {
        "benchmark": "soak",
        "label": args.label,
        "machine": machine(),
        "minutes": args.minutes,
        "sessions": args.sessions,
        "gaps": {"short_s": args.short, "long_s": args.long, "long_share": args.long_share},
        "client_pool_expiries_s": POOL_EXPIRIES,
        "prompt_kb": args.prompt_kb,
        "proxy_flags": proxy_flags(args),
        "seconds": elapsed,
        "upstream": counters,
        **summary,
    }
    path = write_json(f"soak_{args.label}.json", report)
    print(
        f"{args.label}: {summary['requests']} requests in {elapsed / 60:.1f} min, {args.sessions} "
        f"sessions, gaps ~{args.short:g} s and ~{args.long:g} s: {outcome_line(summary, counters)}; "
        f"lost on first turns/after short/long gaps "
        f"{by_band['first']}/{by_band['short']}/{by_band['long']}, 429s {summary['http_429']} "
        f"-> {path}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
