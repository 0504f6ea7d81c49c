"""``prefixgate demo``: simulated vLLM ranks, prefixgate in front, a short agent workload.

Starts 4 simulated ranks and prefixgate in this process, replays the same built-in agent
workload once through round robin and once through prefixgate's default policy (fresh ranks each
time), and prints the hit rate, prefill and time to first token the ranks reported, next to the
workload's infinite-cache bound. Needs nothing from outside the repository; takes well under a
minute.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import replace
from typing import Any

from bench.common import OUT_DIR, write_json
from bench.replay import infinite_cache_bound, replay
from bench.sim import SimConfig, start_fleet, stop_fleet
from bench.sim.config import DEFAULT_KV_TOKENS
from bench.workload import agent_sessions
from proxy.app import create_app
from proxy.config import Settings, load_settings
from proxy.server import ServerThread


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--ranks", type=int, default=4, help="simulated ranks (default 4)")
    parser.add_argument("--sessions", type=int, default=12, help="concurrent agent sessions (default 12)")
    parser.add_argument("--turns", type=int, default=6, help="turns per session (default 6)")
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=DEFAULT_KV_TOKENS,
        help="KV pool of each rank in tokens (default %(default)s)",
    )
    parser.add_argument(
        "--time-scale", type=float, default=0.05, help="simulated-time factor of the ranks (default 0.05)"
    )
    parser.add_argument(
        "--policies",
        default=None,
        help="comma-separated policies to compare (default: round_robin and prefixgate's default)",
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")


def run_one(policy: str, args: argparse.Namespace, sim: SimConfig) -> dict[str, Any]:
    fleet = start_fleet(args.ranks, sim)
    flags: dict[str, Any] = {"policy": policy, "log_level": "warning"}
    if policy == "round_robin":
        # the baseline is what a fleet has without prefixgate: a plain load balancer, every stage off
        flags.update(no_admission=True, no_canonicalize=True)
    try:
        settings: Settings = load_settings(
            flags=flags,
            backend_specs=[f"{r.name}={r.url}" for r in fleet],
            environ={},
        )
        with ServerThread(create_app(settings)) as proxy:
            sessions = agent_sessions(args.sessions, args.turns, seed=args.seed)
            result = asyncio.run(replay(proxy.url, sessions, sim.model))
    finally:
        stop_fleet(fleet)
    summary = result.summary()
    summary["bound"] = infinite_cache_bound(result.requests, sim.block_size)
    summary["first_errors"] = result.errors[:3]
    summary["turns"] = [
        {
            "sent_s": t.sent_s,
            "prompt_tokens": t.prompt_tokens,
            "cached_tokens": t.cached_tokens,
            "ttft_s": t.ttft_s,
        }
        for t in result.turns
    ]
    return summary


def _plots(results: dict[str, dict[str, Any]], turns: dict[str, list[dict[str, Any]]]) -> None:
    """Hit rate over the replay, prefill and TTFT CDF as PNGs, when matplotlib is installed."""
    try:
        from bench.plots import write_plots

        data = {policy: {**r, "turns": turns[policy]} for policy, r in results.items()}
        bound = next(iter(results.values()))["bound"]
        paths = write_plots("demo", data, bound, OUT_DIR / "demo")
    except RuntimeError as exc:  # matplotlib missing: the table above is the result
        print(f"no plots: {exc}")
        return
    print("plots: " + ", ".join(str(p) for p in paths))


def run(args: argparse.Namespace) -> int:
    sim = replace(SimConfig(), kv_tokens=args.kv_tokens, time_scale=args.time_scale)
    default_policy = Settings().policy
    policies = args.policies.split(",") if args.policies else ["round_robin", default_policy]
    policies = list(dict.fromkeys(policies))
    print(
        f"prefixgate demo: {args.ranks} simulated vLLM ranks ({args.kv_tokens:,} KV tokens each), "
        f"{args.sessions} agent sessions x {args.turns} turns, shared system prompt and tools"
    )
    results: dict[str, dict[str, Any]] = {}
    for policy in policies:
        started = time.perf_counter()
        how = (
            "a plain round robin (prefixgate with every stage off)"
            if policy == "round_robin"
            else (f"prefixgate --policy {policy}")
        )
        print(f"  replaying through {how} ...", flush=True)
        results[policy] = run_one(policy, args, sim)
        print(f"    done in {time.perf_counter() - started:.1f}s", flush=True)
    print()
    header = f"{'policy':<18}{'requests':>9}{'errors':>7}{'hit rate':>10}{'bound':>8}{'prefill tok':>13}"
    print(header + f"{'TTFT p50':>10}{'TTFT p99':>10}")
    for policy, r in results.items():
        print(
            f"{policy:<18}{r['requests']:>9}{r['errors']:>7}{r['hit_rate']:>10.1%}{r['bound']:>8.1%}"
            f"{r['prefill_tokens']:>13,}{r['ttft_p50_ms']:>8.1f}ms{r['ttft_p99_ms']:>8.1f}ms"
        )
    print("\nhit rate = cached tokens / prompt tokens as the ranks reported them (usage.cached_tokens);")
    print("bound = the same workload on one rank with an unlimited KV pool.")
    options = {k: v for k, v in vars(args).items() if k != "handler" and not k.startswith("_")}
    turns = {policy: r.pop("turns") for policy, r in results.items()}
    path = write_json("demo.json", {"args": options, "results": results})
    print(f"wrote {path}")
    _plots(results, turns)
    failed = [p for p, r in results.items() if r["errors"]]
    for policy in failed:
        print(f"errors with {policy}: {results[policy]['first_errors']}", file=sys.stderr)
    return 1 if failed else 0
