"""Load: 1,000 concurrent streaming sessions through prefixgate for a bounded time.

Fast stub ranks (own processes) stand in for vLLM. Each session is a task that loops until the
phase ends: it sends its growing conversation (``x-session-id``), streams the answer to the end and
checks it ends with ``data: [DONE]``. Phases, all at the same concurrency:

1. ``direct``: sessions spread over the ranks without prefixgate (the latency baseline);
2. ``one_proxy``: through one ``prefixgate serve`` process;
3. ``two_proxies``: half the sessions through each of two processes sharing a Redis prefix index
   (``--redis-url``; skipped when ``redis-server`` is not installed).

Per phase: requests completed, errors (must be 0), p50/p99 time to last byte, and for the proxied
phases the latency added over ``direct`` plus each proxy's RSS and open file descriptors sampled
every 2 s (RSS must stay flat: growth past the warm-up is reported per minute) and its event-loop
lag (``prefixgate_event_loop_lag_seconds``, read before and after the phase). During the proxied
phases a new session's first turn of ``--first-turn-tokens`` tokens (50k) arrives every
``--first-turn-every`` seconds: tokenizing it must not hold up the small requests. The machine has 2
cores shared by the client, the ranks and the proxies, so the absolute latencies are queueing; the
comparison between phases is what matters.

    python -m bench.load [--sessions 1000] [--seconds 45] [--direct-seconds 15] [--two-seconds 30]
        [--proxy-yaml FILE] [--pool-tokens N] [--proxy-arg=--FLAG ...] [--proxy-root DIR]

``--proxy-yaml`` merges a YAML file (e.g. ``session_memory_mb: 16``) into a generated
``--config`` whose backends are the stub ranks (with ``pool_tokens`` when ``--pool-tokens`` is
given, bounding each rank's prefix-index mirror); ``--proxy-arg`` adds a ``prefixgate serve`` flag.
Both apply to every proxied phase, so small bounds show whether RSS levels off. The proxies use
the embedded tokenizer unless the YAML sets ``tokenization`` (``common.EMBEDDED_TOKENIZER_YAML``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml

from bench import loop_lag
from bench.common import (
    Subprocess,
    machine,
    positive_seconds,
    proxy_process,
    redis_server,
    stub_rank_process,
    write_json,
)
from bench.load_sessions import WARMUP_S, proxy_config, run_phase, summarize

SAMPLE_EVERY_S = 2.0
WINDOW_S = 30.0


def raise_fd_limit(wanted: int = 65_536) -> int:
    """Raise the soft open-files limit (1,000 sessions need 2-3 sockets each across the processes)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = min(wanted, hard) if hard != resource.RLIM_INFINITY else wanted
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class Sampler(threading.Thread):
    """RSS (MB) and open fds of processes every ``SAMPLE_EVERY_S`` seconds."""

    def __init__(self, pids: list[int]) -> None:
        super().__init__(daemon=True)
        self.procs = [psutil.Process(pid) for pid in pids]
        self.samples: list[dict[str, Any]] = []
        self._halt = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        while not self._halt.is_set():
            row: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 1)}
            for i, proc in enumerate(self.procs):
                with contextlib.suppress(psutil.Error):
                    row[f"rss_mb_{i}"] = round(proc.memory_info().rss / 2**20, 1)
                    row[f"fds_{i}"] = proc.num_fds()
            self.samples.append(row)
            self._halt.wait(SAMPLE_EVERY_S)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


def memory_summary(samples: list[dict[str, Any]], index: int) -> dict[str, Any]:
    key = f"rss_mb_{index}"
    points = [(s["t"], s[key]) for s in samples if key in s]
    after = [(t, v) for t, v in points if t >= WARMUP_S * 2] or points
    first, last = after[0], after[-1]
    minutes = max((last[0] - first[0]) / 60, 1e-9)
    fds = [s[f"fds_{index}"] for s in samples if f"fds_{index}" in s]
    return {
        "rss_mb_start": points[0][1],
        "rss_mb_after_warmup": first[1],
        "rss_mb_end": last[1],
        "rss_mb_max": max(v for _, v in points),
        "rss_growth_mb_per_min_after_warmup": round((last[1] - first[1]) / minutes, 2),
        "fds_max": max(fds) if fds else None,
        "fds_end": fds[-1] if fds else None,
    }


def rss_windows(samples: list[dict[str, Any]], index: int, window: float = WINDOW_S) -> list[dict[str, Any]]:
    """RSS at the end of each ``window`` seconds and its growth over that window (MB)."""
    key = f"rss_mb_{index}"
    points = [(s["t"], s[key]) for s in samples if key in s]
    rows: list[dict[str, Any]] = []
    prev = points[0][1] if points else None
    edge = window
    for t, v in points:
        if t >= edge:
            rows.append({"t_end": round(edge), "rss_mb": v, "growth_mb": round(v - prev, 1)})
            prev, edge = v, edge + window
    return rows


def proxied_phase(
    proxies: list[tuple[Subprocess, str]], sessions: int, seconds: float, args: argparse.Namespace
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    pids = [p.proc.pid for p, _ in proxies if p.proc is not None]
    urls = [url for _, url in proxies]
    sampler = Sampler(pids)
    lag_before = [loop_lag.scrape(url) for url in urls]
    sampler.start()
    stats = asyncio.run(run_phase(urls, sessions, seconds, args.first_turn_tokens, args.first_turn_every))
    lag = [loop_lag.summary(b, loop_lag.scrape(url)) for b, url in zip(lag_before, urls, strict=True)]
    time.sleep(SAMPLE_EVERY_S)  # one sample after the load, with the sessions' sockets closed
    sampler.stop()
    result = summarize(stats, seconds)
    result["proxies"] = [
        {
            **memory_summary(sampler.samples, i),
            "rss_windows": rss_windows(sampler.samples, i),
            "loop_lag": lag[i],
        }
        for i in range(len(pids))
    ]
    return result, sampler.samples


def print_table(results: dict[str, Any]) -> None:
    print(f"{'phase':<12} {'done':>7} {'req/s':>7} {'errors':>6} {'p50 ms':>8} {'p99 ms':>8}    +p50    +p99")
    for name, r in results.items():
        if not isinstance(r, dict) or "completed" not in r:
            continue
        print(
            f"{name:<12} {r['completed']:>7} {r['requests_per_s']:>7} {r['errors']:>6} {r['p50_ms']:>8} "
            f"{r['p99_ms']:>8} {r.get('added_p50_ms', ''):>7} {r.get('added_p99_ms', ''):>7}"
        )
        if r["errors"]:
            print(f"   errors by kind: {r['error_kinds']}")
        if "first_turns" in r:
            print(f"   first turns of {r['first_turns']} sessions, p50 {r['first_turn_p50_ms']} ms")
        for i, mem in enumerate(r.get("proxies", [])):
            lag = mem["loop_lag"]
            print(
                f"   proxy {i}: event-loop lag p50 <= {lag['p50_ms_at_most']} ms, p99 <= "
                f"{lag['p99_ms_at_most']} ms, max <= {lag['max_ms_at_most']} ms "
                f"({lag['samples']:.0f} samples)"
            )
            print(
                f"   proxy {i}: RSS {mem['rss_mb_start']} -> {mem['rss_mb_after_warmup']} -> "
                f"{mem['rss_mb_end']} MB "
                f"(max {mem['rss_mb_max']}, {mem['rss_growth_mb_per_min_after_warmup']:+} MB/min after "
                f"warm-up), fds max {mem['fds_max']} end {mem['fds_end']}"
            )
            windows = ", ".join(
                f"{w['t_end']}s {w['rss_mb']} ({w['growth_mb']:+})" for w in mem["rss_windows"]
            )
            print(f"     RSS per {WINDOW_S:.0f} s window: {windows}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000)
    parser.add_argument("--seconds", type=positive_seconds, default=45.0, help="time through one proxy")
    parser.add_argument("--direct-seconds", type=positive_seconds, default=15.0, help="time to the ranks")
    parser.add_argument("--two-seconds", type=positive_seconds, default=30.0, help="time through two proxies")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--proxy-yaml", help="YAML settings merged into the proxies' generated --config")
    parser.add_argument("--pool-tokens", type=int, help="each stub rank's pool_tokens in that config")
    parser.add_argument(
        "--proxy-arg", action="append", default=[], help="extra prefixgate serve flag (repeat; use =)"
    )
    parser.add_argument(
        "--first-turn-tokens",
        type=int,
        default=50_000,
        help="during the proxied phases, a new session's first turn of this many tokens (0: none)",
    )
    parser.add_argument("--first-turn-every", type=float, default=2.0, help="seconds between them")
    parser.add_argument("--proxy-root", type=Path, help="run prefixgate from this source tree (a baseline)")
    args = parser.parse_args()
    fd_limit = raise_fd_limit()
    results: dict[str, Any] = {
        "machine": machine(),
        "sessions": args.sessions,
        "fd_soft_limit": fd_limit,
        "warmup_s_excluded": WARMUP_S,
    }
    ranks = [stub_rank_process(chunks=8) for _ in range(args.ranks)]
    with contextlib.ExitStack() as stack:
        for rank, _ in ranks:
            stack.enter_context(rank)
        rank_urls = [url for _, url in ranks]
        rank_specs = [f"stub-{i}={url}" for i, url in enumerate(rank_urls)]
        proxy_extra = list(args.proxy_arg)
        config = proxy_config(rank_urls, args.proxy_yaml, args.pool_tokens)
        stack.callback(config.unlink)
        rank_specs, proxy_extra = [], ["--config", str(config), *proxy_extra]
        results["proxy_config"] = yaml.safe_load(config.read_text())
        results["proxy_extra_args"] = proxy_extra

        print(
            f"direct: {args.sessions} sessions over {len(rank_urls)} stub ranks "
            f"for {args.direct_seconds:.0f} s"
        )
        direct = summarize(
            asyncio.run(run_phase(rank_urls, args.sessions, args.direct_seconds)), args.direct_seconds
        )
        results["direct"] = direct

        print(f"one_proxy: {args.sessions} sessions through one prefixgate for {args.seconds:.0f} s")
        with contextlib.ExitStack() as proxies:
            one = [proxy_process(rank_specs, extra=proxy_extra, root=args.proxy_root)]
            for proc, _ in one:
                proxies.enter_context(proc)
            results["one_proxy"], results["one_proxy_samples"] = proxied_phase(
                one, args.sessions, args.seconds, args
            )

        with redis_server() as redis_url:
            extra = (["--redis-url", redis_url] if redis_url else []) + proxy_extra
            results["two_proxies_redis"] = redis_url is not None
            print(
                f"two_proxies: {args.sessions} sessions through two prefixgate processes "
                f"({'sharing Redis' if redis_url else 'no redis-server found: without Redis'}) "
                f"for {args.two_seconds:.0f} s"
            )
            with contextlib.ExitStack() as proxies:
                two = [proxy_process(rank_specs, extra=extra, root=args.proxy_root) for _ in range(2)]
                for proc, _ in two:
                    proxies.enter_context(proc)
                results["two_proxies"], results["two_proxies_samples"] = proxied_phase(
                    two, args.sessions, args.two_seconds, args
                )

    for name in ("one_proxy", "two_proxies"):
        r = results[name]
        r["added_p50_ms"] = round(r["p50_ms"] - direct["p50_ms"], 2)
        r["added_p99_ms"] = round(r["p99_ms"] - direct["p99_ms"], 2)
    print_table(results)
    errors = sum(results[n]["errors"] for n in ("direct", "one_proxy", "two_proxies"))
    path = write_json("load.json", results)
    print(f"wrote {path}; errors in total: {errors}")
    return 1 if errors else 0


if __name__ == "__main__":
    raise SystemExit(main())
