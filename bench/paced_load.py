"""Event-loop lag below saturation: sessions that think between turns, at chosen request rates,
while a new session's 50k-token first turn arrives every 2 s.

``bench/load.py`` saturates the proxy (a closed loop: each session sends its next turn as soon as
the last one ends), and there the loop's lag is its own ready queue. Here the same sessions pause
between turns (exponential think times of mean ``sessions / rate``), so the proxy runs below its
capacity and what a request waits behind whatever holds the loop (a first turn's tokenization, a
garbage collection, a burst of callbacks) shows in ``prefixgate_event_loop_lag_seconds``. Per rate,
the sessions run straight to the stub ranks, then through one ``prefixgate serve``; reported:
requests/s achieved, p50/p99 time to last byte of both and the latency prefixgate added, its loop
lag p50/p99/max (bucket bounds), the share of a core it used, the first turns' p50 and errors.
Before the first rate, the share of a core the proxy uses with no traffic at all for
``--idle-seconds`` (its own timers and checks: what it costs a host while nobody calls it).

    python -m bench.paced_load [--rates 100,300,500] [--sessions 200] [--seconds 20]
        [--first-turn-tokens 50000] [--first-turn-every 2] [--idle-seconds 10] [--proxy-root DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from pathlib import Path
from typing import Any

import psutil

from bench import loop_lag
from bench.common import machine, positive_seconds, proxy_process, stub_rank_process, write_json
from bench.load_sessions import proxy_config, run_phase, summarize
from bench.process_cpu import cpu_seconds, idle_share


def paced_phase(urls: list[str], args: argparse.Namespace, rate: float, first_turns: bool) -> dict[str, Any]:
    """``args.sessions`` sessions over ``urls`` for ``args.seconds`` at about ``rate`` requests/s."""
    think_s = args.sessions / rate
    stats = asyncio.run(
        run_phase(
            urls,
            args.sessions,
            args.seconds,
            args.first_turn_tokens if first_turns else 0,
            args.first_turn_every,
            think_s,
        )
    )
    return {"rate_asked": rate, "think_s": round(think_s, 3), **summarize(stats, args.seconds)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="100,300,500", help="requests/s to pace at, comma-separated")
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--seconds", type=positive_seconds, default=20.0, help="time per phase")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--first-turn-tokens", type=int, default=50_000, help="0: no large first turns")
    parser.add_argument("--first-turn-every", type=float, default=2.0, help="seconds between them")
    parser.add_argument(
        "--idle-seconds", type=positive_seconds, default=10.0, help="time measured with no traffic first"
    )
    parser.add_argument("--proxy-root", type=Path, help="run prefixgate from this source tree (a baseline)")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if not rates or min(rates) <= 0:
        parser.error("--rates: one or more positive requests/s")
    results: dict[str, Any] = {"machine": machine(), "sessions": args.sessions, "rates": []}
    ranks = [stub_rank_process(chunks=8) for _ in range(args.ranks)]
    with contextlib.ExitStack() as stack:
        for rank, _ in ranks:
            stack.enter_context(rank)
        rank_urls = [url for _, url in ranks]
        config = proxy_config(rank_urls, None, None)
        stack.callback(config.unlink)
        proxy, url = proxy_process([], extra=["--config", str(config)], root=args.proxy_root)
        stack.enter_context(proxy)
        assert proxy.proc is not None
        cpu = psutil.Process(proxy.proc.pid)
        results["idle_core_share"] = idle = round(idle_share(cpu, args.idle_seconds), 4)
        print(f"idle: {idle:.4f} of a core over {args.idle_seconds:g} s with no traffic")
        print(
            f"{'rate':>6} {'req/s':>7} {'direct p50/p99 ms':>18} {'prefixgate p50/p99':>19} {'+p50':>6}  "
            f"{'loop lag p50/p99/max ms':>24} {'core':>5} {'1st turn':>9} errors"
        )
        for rate in rates:
            direct = paced_phase(rank_urls, args, rate, first_turns=False)
            before, cpu_before = loop_lag.scrape(url), cpu_seconds(cpu)
            proxied = paced_phase([url], args, rate, first_turns=True)
            lag = loop_lag.summary(before, loop_lag.scrape(url))
            used = (cpu_seconds(cpu) - cpu_before) / args.seconds
            proxied.update(
                loop_lag=lag,
                proxy_core_share=round(used, 2),
                added_p50_ms=round(proxied["p50_ms"] - direct["p50_ms"], 2),
            )
            results["rates"].append({"direct": direct, "prefixgate": proxied})
            print(
                f"{rate:>6g} {proxied['requests_per_s']:>7} {direct['p50_ms']:>8} / {direct['p99_ms']:<8}"
                f"{proxied['p50_ms']:>9} / {proxied['p99_ms']:<8} {proxied['added_p50_ms']:>6}  "
                f"{lag['p50_ms_at_most']!s:>7} / {lag['p99_ms_at_most']!s:>6} / {lag['max_ms_at_most']!s:<7} "
                f"{used:>5.2f} {proxied.get('first_turn_p50_ms', '-')!s:>9} "
                f"{direct['errors'] + proxied['errors']}"
            )
    errors = sum(r["direct"]["errors"] + r["prefixgate"]["errors"] for r in results["rates"])
    path = write_json("paced_load.json", results)
    print(f"wrote {path}; errors in total: {errors}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
