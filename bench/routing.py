"""Routing benchmark: prefix index lookup cost, and fleet hit rate per policy on replayed Claude Code traces.

Part 1, lookup cost: median time of one ``lookup`` for a 100k-token prompt (6,250 blocks of 16) that
4 ranks hold fully, in memory and in Redis on loopback (a redis-server is started on a free port).

Part 2, replay: the trace machinery of ``prefixgate bench`` (``bench.traces``, ``bench.replay``,
``bench.systems``) with prefixgate alone. For each policy in turn, a fresh fleet of 4 simulated ranks
(pools of 181,777 tokens) and ``prefixgate serve --policy P`` in front of it, each in its own process;
``--sessions`` Claude Code conversations (those whose every request, sub-agents included, stays under
``--max-prompt-tokens``: they fit a rank's pool and the sim's context) replayed concurrently, their
first ``--turns`` requests each. Reported per policy, from what the ranks report: fleet hit rate
(cached / prompt tokens of the ranks' ``usage``, and the ranks' own prefix-cache counters), prefill
tokens, next to the infinite-cache bound of the requests as sent.

Run time: requests are few but long (tens of thousands of tokens), so the cost is tokenizing and
hashing them (prefixgate and the ranks) and the ranks' modelled GPU time; ``--sim-time-scale``
compresses the latter (0.25: a 50k-token prefill of 2.5 s takes 0.6 s, enough for queues to form at
the ranks, which is what load-aware policies react to) and ``--time-scale`` the trace's think times
(0.005: a minute of thought takes 0.3 s). The defaults (16 conversations, every request of each:
about 300 requests per policy) take about 2 minutes on 2 cores.

    python bench/routing.py [--sessions 16] [--turns 0] [--policies prefix_affinity,round_robin,...]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import OUT_DIR, median, percentile, redis_server, write_json  # noqa: E402
from bench.sim.config import DEFAULT_KV_TOKENS  # noqa: E402
from routing.index.memory import MemoryPrefixIndex  # noqa: E402
from routing.policies import POLICIES  # noqa: E402

LOOKUP_TOKENS = 100_000
LOOKUP_BLOCK = 16


def _hashes(n: int, tag: str) -> list[bytes]:
    import hashlib

    out, prev = [], tag.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "big")).digest()
        out.append(prev)
    return out


def _time(fn: Any, repeats: int) -> dict[str, float]:
    fn()  # warm caches and connections
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1000)
    return {"median_ms": median(samples), "p90_ms": percentile(samples, 90)}


def lookup_cost(repeats: int = 200) -> dict[str, Any]:
    """Median lookup time for a 100k-token prompt's blocks held by 4 ranks, memory and Redis."""
    from routing.index.redis_store import RedisPrefixIndex

    blocks = _hashes(LOOKUP_TOKENS // LOOKUP_BLOCK, "lookup")
    results: dict[str, Any] = {}
    memory = MemoryPrefixIndex()
    for r in range(4):
        memory.set_capacity(f"r{r}", None)
        memory.record(f"r{r}", blocks)
    results["memory"] = _time(lambda: memory.lookup(blocks, "s"), repeats)
    with redis_server() as url:
        if url is None:
            results["redis"] = None
            return results
        store = RedisPrefixIndex(url, model="bench", block_size=LOOKUP_BLOCK)
        for r in range(4):
            store.set_capacity(f"r{r}", None)
            store.record(f"r{r}", blocks)
        if store.match(blocks) != {f"r{r}": len(blocks) for r in range(4)}:
            raise RuntimeError("the Redis index does not hold the recorded blocks")
        results["redis"] = _time(lambda: store.lookup(blocks, "s"), repeats)
        results["redis_record"] = _time(lambda: store.record("r0", blocks), max(repeats // 4, 10))
        store.close()
    return results


def replay_policies(args: argparse.Namespace) -> dict[str, Any]:
    """Replay the selected conversations through prefixgate once per policy, each on a fresh fleet."""
    from bench.bench_presets import Preset, time_scaled_prefixgate_flags
    from bench.replay import TraceReplayConfig, TurnResult
    from bench.system_run import run_system
    from bench.systems import FleetConfig, prefixgate_systems
    from bench.traces import load_claude_code, trace_block_reuse

    sessions = load_claude_code(max_prompt_tokens=args.max_prompt_tokens, max_requests=args.turns or None)
    random.Random(args.seed).shuffle(sessions)
    sessions = sessions[: args.sessions]
    every = [s for top in sessions for s in top.all_sessions()]
    n_requests = sum(len(s.requests) for s in every)
    fleet = FleetConfig(ranks=args.ranks, kv_tokens=args.kv_tokens, time_scale=args.sim_time_scale)
    replay_config = TraceReplayConfig(
        model=fleet.model,
        concurrency=len(sessions),
        time_scale=args.time_scale,
        max_tokens=8,
        block_tokens=64,
        kv_block_size=fleet.block_size,
        seed=args.seed,
    )
    # prefixgate's session TTL and admission wait compressed like the replay's clocks
    clocks = Preset(time_scale=args.time_scale, sim_time_scale=args.sim_time_scale)
    prefixgate_args = time_scaled_prefixgate_flags(clocks)
    which = f"first {args.turns}" if args.turns else "all"
    print(
        f"\nreplay: {len(sessions)} Claude Code conversations at once ({len(every)} sessions with "
        f"sub-agents), {which} requests of each, every request under {args.max_prompt_tokens:,} "
        f"tokens: {n_requests} requests per policy, trace block reuse {trace_block_reuse(every):.3f}\n"
        f"        {args.ranks} simulated ranks x {args.kv_tokens:,} KV tokens; model time x "
        f"{args.sim_time_scale:g}, think times x {args.time_scale:g} (cut to 60 s); prefixgate "
        f"{' '.join(prefixgate_args)}",
        flush=True,
    )
    out_dir = OUT_DIR / "routing_logs"

    def on_turn(turn: TurnResult) -> None:
        pass

    runs: list[dict[str, Any]] = []
    for spec in prefixgate_systems([p.strip() for p in args.policies.split(",") if p.strip()]):
        try:
            r = run_system(spec, sessions, fleet, replay_config, out_dir, on_turn, prefixgate_args)
        except Exception as exc:  # one policy failing must not lose the others' figures
            runs.append({"policy": spec.policy, "failed": f"{type(exc).__name__}: {exc}"})
            print(f"{spec.policy}: failed: {exc}", flush=True)
            continue
        r.pop("turns")
        runs.append({"policy": spec.policy, **r})
        print(
            f"  {spec.policy}: {r['requests']} requests in {r['run_s']:.0f}s, hit rate {r['hit_rate']:.3f}",
            flush=True,
        )
    return {
        "conversations": len(sessions),
        "sessions": len(every),
        "turns": args.turns,
        "requests_per_policy": n_requests,
        "max_prompt_tokens": args.max_prompt_tokens,
        "ranks": args.ranks,
        "kv_tokens": args.kv_tokens,
        "sim_time_scale": args.sim_time_scale,
        "time_scale": args.time_scale,
        "prefixgate_args": prefixgate_args,
        "trace_block_reuse": trace_block_reuse(every),
        "runs": runs,
    }


def print_replay(replay: dict[str, Any]) -> None:
    print(
        f"\n{'policy':16s} {'hit rate':>9s} {'rank ctr':>9s} {'bound':>7s} {'/ bound':>8s} "
        f"{'prefill tok':>12s} {'preempt':>8s} {'TTFT p50':>9s} {'errors':>7s} {'run s':>6s}"
    )
    for r in replay["runs"]:
        if "failed" in r:
            print(f"{r['policy']:16s} failed: {r['failed'][:80]}")
            continue
        ratio = r["hit_rate"] / r["bound"] if r["bound"] else 0.0
        print(
            f"{r['policy']:16s} {r['hit_rate']:9.3f} {r['rank_prefix_cache_hit_rate']:9.3f} "
            f"{r['bound']:7.3f} "
            f"{ratio:8.3f} {r['prefill_tokens']:12,d} {r['preemptions']:8d} {r['ttft_p50_ms']:7.0f}ms "
            f"{r['errors']:7d} {r['run_s']:6.0f}"
        )
    done = [r for r in replay["runs"] if "failed" not in r]
    if done:
        r = done[0]
        print(
            "hit rate: cached / prompt tokens of the ranks' usage; rank ctr: the ranks' prefix-cache "
            "hits / queries (/metrics);\nbound: one rank with an unlimited pool; working set "
            f"{r['working_set_mean_x_pools']:.2f}x the pools on average "
            f"(peak {r['working_set_peak_x_pools']:.2f}x)"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sessions", type=int, default=16, help="concurrent Claude Code conversations")
    parser.add_argument(
        "--turns", type=int, default=0, help="first N requests of each conversation (0: all of them)"
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=100_000,
        help="only conversations whose requests all stay under this (fits a pool and the sim's context)",
    )
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--kv-tokens", type=int, default=DEFAULT_KV_TOKENS)
    parser.add_argument("--sim-time-scale", type=float, default=0.25, help="ranks' model time factor")
    parser.add_argument("--time-scale", type=float, default=0.005, help="factor on the trace's think times")
    parser.add_argument("--seed", type=int, default=0, help="conversation order and block text seed")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--skip-replay", action="store_true")
    args = parser.parse_args(argv)

    started = time.perf_counter()
    out: dict[str, Any] = {"lookup": lookup_cost()}
    print(
        f"index lookup, {LOOKUP_TOKENS // 1000}k-token prompt ({LOOKUP_TOKENS // LOOKUP_BLOCK:,} blocks), "
        "4 ranks holding it:"
    )
    for store, r in out["lookup"].items():
        if r:
            print(f"  {store:13s} median {r['median_ms']:.3f} ms   p90 {r['p90_ms']:.3f} ms")
        else:
            print(f"  {store:13s} skipped: no redis-server on PATH")
    failed = False
    if not args.skip_replay:
        from bench.traces import TracesMissing

        try:
            out["replay"] = replay_policies(args)
        except TracesMissing as exc:
            print(f"replay skipped: {exc}")
        else:
            print_replay(out["replay"])
            failed = any("failed" in r or r["errors"] for r in out["replay"]["runs"])
    out["wall_s"] = time.perf_counter() - started
    path = write_json("routing.json", out)
    print(f"\nwrote {path} ({out['wall_s']:.0f}s)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
