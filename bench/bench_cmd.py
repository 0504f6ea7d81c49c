"""``prefixgate bench``: replay agent traces through prefixgate's policies and peer routers, side by side.

Every system gets the same trace, the same seed and a fresh simulated fleet (K ranks, given KV
pools, in a subprocess); systems run one after the other. Everything measured comes from what the
ranks report: hit rate = cached tokens / prompt tokens of the ranks' ``usage``, prefill = prompt -
cached tokens, preemptions and prefix-cache counters from the ranks' ``/metrics``; TTFT and
end-to-end latency from the client; the proxy's CPU time per request from the OS (each system runs
in its own process). Beside them: the infinite-cache bound of the requests as sent (one rank, an
unlimited pool) and the trace's own block reuse. ``/ RR`` is prefill against ``plain round_robin``:
a plain load balancer dealing requests out in turn, what a fleet has without prefixgate (prefixgate's
proxy with every stage off, so nothing needs installing); ``prefixgate round_robin`` is round robin
with prefixgate's admission control and canonicalization on.

Scenarios: ``fits`` (few concurrent conversations: their working set stays under the pools) and
``over`` (many: the working set exceeds the pools; the table says by how much). Presets:

  small   Claude Code, 2 ranks x 181,777 tokens, 10 conversations x 6 requests, scenario over:
          under 2 minutes on 2 cores
  full    Claude Code, 4 ranks x 181,777 tokens, every conversation whose requests all stay under
          100k tokens (40, 806 requests), scenarios fits (6 concurrent) and over (20 concurrent):
          about 7 minutes on 2 cores, see docs/benchmarks.md

Mooncake JSONL (``--trace mooncake-conversation|mooncake-synthetic``) has no session ids: requests
re-sending an earlier one are grouped into conversations, and ``--conversations`` (default 300,
0 for the whole file) takes whole families of conversations sharing a prefix, in order of arrival.

Time is compressed: think times (cut to 60 s) x ``--time-scale``, the ranks' modelled GPU time x
``--sim-time-scale``, and prefixgate's session idle TTL and admission wait likewise. Requests are
streamed with ``--max-tokens`` output tokens (the trace's own output is in the next request's ids);
a 429/503 is retried like an agent would (counted in the table).

Output: a table per scenario, ``results.json`` and PNG plots in ``--out``. The traces are read from
``../shared/traces`` (``--traces``); the command stops with a clear message when they are absent.
Peers come from ``bench/peers/install.sh`` (a virtualenv outside the repository; ``--install-peers``
runs it); without them only prefixgate's policies run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.replay import ReplayResult, TraceReplayConfig, TurnResult, bound_hit_rate, replay_trace
from bench.sim.config import DEFAULT_KV_TOKENS
from bench.traces import (
    CLAUDE_CODE_DIR,
    MOONCAKE_DIR,
    TraceSession,
    TracesMissing,
    load_claude_code,
    load_mooncake,
    reuse_breakdown,
    trace_block_reuse,
)

if TYPE_CHECKING:  # psutil (the ``bench`` extra) is imported only when a benchmark runs
    from bench.systems import FleetConfig, SystemSpec

DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "bench"


@dataclass(frozen=True, slots=True)
class Preset:
    trace: str = "claude-code"
    conversations: int | None = 12
    max_requests: int | None = 10
    max_prompt_tokens: int = 100_000
    scenarios: tuple[str, ...] = ("over",)
    #: Concurrent conversations per scenario.
    fits_concurrency: int = 4
    over_concurrency: int = 12
    ranks: int = 4
    kv_tokens: int = DEFAULT_KV_TOKENS
    sim_time_scale: float = 0.02
    time_scale: float = 0.005
    max_tokens: int = 8


#: Conversations a Mooncake replay takes by default (the first ones to arrive, each whole).
MOONCAKE_CONVERSATIONS = 300

PRESETS: dict[str, Preset] = {
    # Two ranks so a dozen short conversations already crowd the pools.
    "small": Preset(ranks=2, conversations=10, max_requests=6, over_concurrency=10),
    "full": Preset(
        conversations=None,
        max_requests=None,
        scenarios=("fits", "over"),
        fits_concurrency=6,
        over_concurrency=20,
    ),
}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``bench`` command's flags to ``parser``."""
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--preset", choices=sorted(PRESETS), default="small", help="(default small)")
    parser.add_argument(
        "--trace",
        choices=["claude-code", "mooncake-conversation", "mooncake-synthetic"],
        default=None,
        help="trace to replay (default: the preset's, claude-code)",
    )
    parser.add_argument("--traces", type=Path, default=None, help="trace folder or Mooncake JSONL file")
    parser.add_argument("--scenarios", default=None, help="fits,over (default: the preset's)")
    parser.add_argument("--conversations", type=int, default=None, help="conversations to replay")
    parser.add_argument("--max-requests", type=int, default=None, help="first N requests of each")
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="skip conversations with a longer request"
    )
    parser.add_argument("--fits-concurrency", type=int, default=None, help="concurrent sessions (fits)")
    parser.add_argument("--over-concurrency", type=int, default=None, help="concurrent sessions (over)")
    parser.add_argument("--ranks", type=int, default=None, help="simulated ranks (default 4)")
    parser.add_argument(
        "--kv-tokens", type=int, default=None, help=f"KV pool per rank in tokens ({DEFAULT_KV_TOKENS})"
    )
    parser.add_argument(
        "--sim-time-scale", type=float, default=None, help="simulated-time factor of the ranks (default 0.02)"
    )
    parser.add_argument(
        "--time-scale", type=float, default=None, help="factor on the trace's think times (default 0.005)"
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 8)")
    parser.add_argument(
        "--systems",
        default=None,
        help="comma-separated system names (default: plain round robin, every prefixgate policy and "
        "every peer); plain:round_robin (a plain load balancer: prefixgate with every stage off, the "
        "baseline of '/ RR'), prefixgate:<policy>, 'sglang cache_aware', 'vllm-router cache_aware', "
        "'vllm-router consistent_hash'",
    )
    parser.add_argument("--no-peers", action="store_true", help="only prefixgate's policies")
    parser.add_argument(
        "--prefixgate-args", default="", help="extra flags for prefixgate serve, e.g. '--no-admission'"
    )
    parser.add_argument(
        "--prefixgate-root", type=Path, default=None, help="run prefixgate from this source tree (a snapshot)"
    )
    parser.add_argument("--install-peers", action="store_true", help="run bench/peers/install.sh first")
    parser.add_argument("--seed", type=int, default=0, help="conversation order and block text seed")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output folder (default bench/out/bench)"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def available_policies() -> list[str]:
    """prefixgate's routing policies, as ``routing.policies`` knows them at run time."""
    from routing import policies as policy_module

    names = list(getattr(policy_module, "POLICIES", ("round_robin",)))
    usable = []
    for name in names:
        try:
            policy_module.make_policy(name)
        except Exception:  # a policy still being written: leave it out, say so in the table
            continue
        usable.append(name)
    # round robin first: the baseline every other row is read against
    return sorted(usable, key=lambda n: (n != "round_robin", names.index(n)))


def resolve(args: argparse.Namespace) -> Preset:
    preset = PRESETS[args.preset]
    overrides: dict[str, Any] = {}
    for field in (
        "trace",
        "conversations",
        "max_requests",
        "max_prompt_tokens",
        "fits_concurrency",
        "over_concurrency",
        "ranks",
        "kv_tokens",
        "sim_time_scale",
        "time_scale",
        "max_tokens",
    ):
        value = getattr(args, field)
        if value is not None:
            overrides[field] = value
    if overrides.get("trace", preset.trace).startswith("mooncake"):
        # The presets' cuts are sized for Claude Code's long conversations; Mooncake's are short
        # (1.5 requests on average) and a whole one is what carries its reuse.
        overrides.setdefault("conversations", MOONCAKE_CONVERSATIONS)
        overrides.setdefault("max_requests", None)
    if args.scenarios:
        overrides["scenarios"] = tuple(s.strip() for s in args.scenarios.split(",") if s.strip())
    return replace(preset, **overrides)


def load_sessions(preset: Preset, traces: Path | None, seed: int) -> tuple[list[TraceSession], int]:
    """The conversations to replay (seeded order) and the token length of one trace block."""
    if preset.trace == "claude-code":
        sessions = load_claude_code(
            traces or CLAUDE_CODE_DIR,
            max_prompt_tokens=preset.max_prompt_tokens,
            max_requests=preset.max_requests,
        )
        random.Random(seed).shuffle(sessions)
        return sessions[: preset.conversations] if preset.conversations else sessions, 64
    name = f"{preset.trace.removeprefix('mooncake-')}_trace.jsonl.gz"
    path = traces if traces is not None and traces.is_file() else (traces or MOONCAKE_DIR) / name
    sessions = load_mooncake(
        path,
        limit=preset.conversations or None,  # 0: the whole file, as for Claude Code
        max_prompt_tokens=preset.max_prompt_tokens,
        max_requests=preset.max_requests,
    )
    return sessions, 512


def time_scaled_prefixgate_flags(preset: Preset) -> list[str]:
    """prefixgate's clocks, compressed like the replay's: a session idle for 5 minutes of trace time is
    idle after 300 x ``time_scale`` seconds here, and a new session waits for room as long as the
    simulated ranks' compressed time would make it (else admission sees sessions that ended long ago
    in trace time as active, and waits in real seconds for work that takes scaled ones)."""
    ttl = max(1.0, 300.0 * preset.time_scale)
    wait = max(0.5, 30.0 * preset.sim_time_scale)
    return ["--session-idle-ttl", f"{ttl:g}", "--admission-wait", f"{wait:g}"]


def select_systems(args: argparse.Namespace) -> tuple[list[SystemSpec], list[str]]:
    """The systems to run, and notes on what was left out and why."""
    from bench import peers
    from bench.systems import PLAIN_ROUND_ROBIN, peer_systems, prefixgate_systems

    notes: list[str] = []
    systems = [PLAIN_ROUND_ROBIN, *prefixgate_systems(available_policies())]
    if not args.no_peers:
        if args.install_peers:
            peers.install()
        if peers.installed():
            systems += peer_systems()
        else:
            notes.append(f"peers not installed in {peers.peers_dir()} (run {peers.INSTALL_SCRIPT}): skipped")
    if args.systems:
        wanted = [w.strip() for w in args.systems.split(",") if w.strip()]
        by_name = {s.name: s for s in systems}
        policies = (s for s in systems if s.kind == "prefixgate" and not s.args)
        by_name.update({f"prefixgate:{s.policy}": s for s in policies})
        by_name["plain:round_robin"] = PLAIN_ROUND_ROBIN
        unknown = [w for w in wanted if w not in by_name]
        if unknown:
            raise SystemExit(f"unknown or unavailable systems: {unknown}; available: {sorted(by_name)}")
        systems = list(dict.fromkeys(by_name[w] for w in wanted))
    return systems, notes


def run_system(
    spec: SystemSpec,
    sessions: list[TraceSession],
    fleet_config: FleetConfig,
    replay_config: TraceReplayConfig,
    out: Path,
    on_turn: Any,
    prefixgate_args: Sequence[str] = (),
    prefixgate_root: Path | None = None,
) -> dict[str, Any]:
    """One system on a fresh fleet: replay, then read the ranks' counters and the proxy's CPU."""
    from bench.systems import ProcessCpu, SimFleetProcess, system_under_test

    started = time.perf_counter()
    logs = out / "logs"
    with SimFleetProcess(fleet_config, log=logs / "sim.log") as fleet:
        with system_under_test(spec, fleet.urls, logs, prefixgate_args, prefixgate_root) as running:
            cpu = ProcessCpu(running.pid)
            cpu.start()
            result = asyncio.run(replay_trace(running.url, sessions, replay_config, on_turn))
            cpu.stop()
        counters = fleet.metrics()
    return summarize(result, counters, cpu.seconds, fleet_config, time.perf_counter() - started)


def summarize(
    result: ReplayResult, counters: dict[str, float], cpu_s: float | None, fleet: FleetConfig, run_s: float
) -> dict[str, Any]:
    summary = result.summary()
    queries = counters["vllm:prefix_cache_queries"]
    pool = fleet.ranks * fleet.kv_tokens
    summary.update(
        {
            "bound": bound_hit_rate(result),
            "completed_sessions": result.completed_sessions,
            "rank_prefix_cache_hit_rate": counters["vllm:prefix_cache_hits"] / queries if queries else 0.0,
            "preemptions": int(counters["vllm:num_preemptions"]),
            "rank_counters": counters,
            "proxy_cpu_s": cpu_s,
            "proxy_cpu_ms_per_request": cpu_s * 1000 / len(result.turns) if cpu_s and result.turns else None,
            "working_set_mean_x_pools": (
                sum(result.working_set) / len(result.working_set) / pool if result.working_set else 0.0
            ),
            "working_set_peak_x_pools": max(result.working_set, default=0) / pool,
            "run_s": run_s,
            "first_errors": result.errors[:3],
            "turns": [
                {k: v for k, v in asdict(t).items() if k not in ("session",)} | {"session": t.session}
                for t in result.turns
            ],
        }
    )
    return summary


def print_table(scenario: str, results: dict[str, dict[str, Any]], notes: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"scenario {scenario}: measured from the ranks' usage and /metrics")
    for column in (
        "system",
        "hit rate",
        "/ bound",
        "prefill Mtok",
        "/ RR",
        "preempt",
        "TTFT p50",
        "TTFT p99",
        "e2e p50",
        "e2e p99",
        "sessions",
        "errors",
        "429s",
        "CPU ms/req",
    ):
        table.add_column(column, justify="left" if column == "system" else "right")
    base = rr_baseline(results)
    for name, r in results.items():
        if "failed" in r:
            table.add_row(name, *["-"] * 12, r["failed"][:40])
            continue
        cpu = r["proxy_cpu_ms_per_request"]
        table.add_row(
            name,
            f"{r['hit_rate']:.3f}",
            f"{r['hit_rate'] / r['bound']:.3f}" if r["bound"] else "-",
            f"{r['prefill_tokens'] / 1e6:.2f}",
            f"{r['prefill_tokens'] / base:.2f}" if base else "-",
            str(r["preemptions"]),
            f"{r['ttft_p50_ms']:.0f}ms",
            f"{r['ttft_p99_ms']:.0f}ms",
            f"{r['latency_p50_ms']:.0f}ms",
            f"{r['latency_p99_ms']:.0f}ms",
            str(r["completed_sessions"]),
            str(r["errors"]),
            str(r["rejections"]),
            f"{cpu:.2f}" if cpu is not None else "-",
        )
    console = Console(width=None if sys.stdout.isatty() else 150)
    console.print(table)
    done = [r for r in results.values() if "failed" not in r]
    if done:
        r = done[0]
        console.print(
            f"infinite-cache bound {r['bound']:.3f}; working set {r['working_set_mean_x_pools']:.2f}x "
            f"the pools on average (peak {r['working_set_peak_x_pools']:.2f}x)"
        )
    for note in notes:
        console.print(f"note: {note}")


def rr_baseline(results: dict[str, dict[str, Any]]) -> int | None:
    """Prefill tokens of the round-robin baseline: the plain one when it ran, else prefixgate's."""
    for name in ("plain round_robin", "prefixgate round_robin"):
        prefill = results.get(name, {}).get("prefill_tokens")
        if prefill:
            return int(prefill)
    return None


def markdown_table(results: dict[str, dict[str, Any]]) -> str:
    """The scenario's results as a Markdown table (for docs/benchmarks.md)."""
    base = rr_baseline(results)
    lines = [
        "| system | hit rate | / bound | prefill Mtok | prefill / RR | preemptions | TTFT p50 | TTFT p99 "
        "| e2e p50 | e2e p99 | sessions | errors | 429s | CPU ms/req |",
        "|---|" + "---:|" * 13,
    ]
    for name, r in results.items():
        if "failed" in r:
            lines.append(f"| {name} | failed: {r['failed'][:60]} |" + " |" * 12)
            continue
        cpu = r["proxy_cpu_ms_per_request"]
        ratio = f"{r['prefill_tokens'] / base:.2f}" if base else "-"
        lines.append(
            f"| {name} | {r['hit_rate']:.3f} | {r['hit_rate'] / r['bound']:.3f} | "
            f"{r['prefill_tokens'] / 1e6:.2f} | {ratio} | {r['preemptions']} | {r['ttft_p50_ms']:.0f} ms | "
            f"{r['ttft_p99_ms']:.0f} ms | {r['latency_p50_ms']:.0f} ms | {r['latency_p99_ms']:.0f} ms | "
            f"{r['completed_sessions']} | {r['errors']} | {r['rejections']} | "
            + (f"{cpu:.1f}" if cpu is not None else "-")
            + " |"
        )
    return "\n".join(lines) + "\n"


def _git_head() -> str | None:
    import subprocess

    try:
        root = Path(__file__).resolve().parents[1]
        proc = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return proc.stdout.strip() or None


def run(args: argparse.Namespace) -> int:
    """Run the comparison; exit status 1 when a system failed or a request errored, 2 without traces."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from bench.systems import FleetConfig

    preset = resolve(args)
    try:
        sessions, block_tokens = load_sessions(preset, args.traces, args.seed)
    except TracesMissing as exc:
        print(f"prefixgate bench: {exc}", file=sys.stderr)
        return 2
    if not sessions:
        print("prefixgate bench: no conversation matched the filters", file=sys.stderr)
        return 2
    systems, notes = select_systems(args)
    all_sessions = [s for top in sessions for s in top.all_sessions()]
    n_requests = sum(len(s.requests) for s in all_sessions)
    fleet = FleetConfig(ranks=preset.ranks, kv_tokens=preset.kv_tokens, time_scale=preset.sim_time_scale)
    print(
        f"prefixgate bench: {preset.trace}, {len(sessions)} conversations "
        f"({len(all_sessions)} sessions counting sub-agents, {n_requests} requests, "
        f"trace block reuse {trace_block_reuse(all_sessions):.3f}); "
        f"{preset.ranks} ranks x {preset.kv_tokens:,} KV tokens; "
        f"systems: {', '.join(s.name for s in systems)}",
        flush=True,
    )
    breakdown = reuse_breakdown(sessions) if preset.trace.startswith("mooncake") else None
    if breakdown is not None:
        print(
            "  of which: shared head {head:.3f}, within conversations {same_session:.3f}, "
            "across conversations {across_sessions:.3f} (fractions of all blocks)".format(**breakdown),
            flush=True,
        )
    args.out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "preset": args.preset,
        "settings": asdict(preset),
        "seed": args.seed,
        "machine": {
            "cpus": __import__("os").cpu_count(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "python": platform.python_version(),
        },
        "conversations": len(sessions),
        "sessions": len(all_sessions),
        "requests_per_system": n_requests,
        "trace_block_reuse": trace_block_reuse(all_sessions),
        "trace_reuse_breakdown": breakdown,
        "notes": notes,
        "scenarios": {},
    }
    prefixgate_args = time_scaled_prefixgate_flags(preset) + shlex.split(args.prefixgate_args)
    report["prefixgate_args"] = prefixgate_args
    report["prefixgate_root"] = str(args.prefixgate_root or Path(__file__).resolve().parents[1])
    report["git_head"] = _git_head()
    started = time.perf_counter()
    failed = False
    for scenario in preset.scenarios:
        concurrency = preset.fits_concurrency if scenario == "fits" else preset.over_concurrency
        replay_config = TraceReplayConfig(
            model=fleet.model,
            concurrency=concurrency,
            time_scale=preset.time_scale,
            max_tokens=preset.max_tokens,
            block_tokens=block_tokens,
            kv_block_size=fleet.block_size,
            seed=args.seed,
        )
        results: dict[str, dict[str, Any]] = {}
        with Progress(
            TextColumn("{task.description:<40}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[hits]}"),
        ) as progress:
            for spec in systems:
                task = progress.add_task(f"{scenario}: {spec.name}", total=n_requests, hits="")
                tally = [0, 0]

                def on_turn(turn: TurnResult, task: Any = task, tally: list[int] = tally) -> None:
                    tally[0] += turn.prompt_tokens
                    tally[1] += turn.cached_tokens
                    hits = f"hit rate {tally[1] / tally[0]:.3f}" if tally[0] else ""
                    progress.update(task, advance=1, hits=hits)

                try:
                    results[spec.name] = run_system(
                        spec,
                        sessions,
                        fleet,
                        replay_config,
                        args.out,
                        on_turn,
                        prefixgate_args,
                        args.prefixgate_root,
                    )
                except Exception as exc:  # one system failing must not lose the others' results
                    results[spec.name] = {"failed": f"{type(exc).__name__}: {exc}"}
                    failed = True
                if results[spec.name].get("errors"):
                    failed = True
                progress.update(task, total=progress.tasks[task].completed)  # stop its clock
        print_table(f"{scenario} ({concurrency} concurrent conversations)", results, notes)
        scenario_report = {"concurrency": concurrency, "results": results}
        report["scenarios"][scenario] = scenario_report
        if not args.no_plots:
            done = {n: r for n, r in results.items() if "failed" not in r}
            if done:
                from bench.plots import write_plots

                bound = next(iter(done.values()))["bound"]
                paths = write_plots(scenario, done, bound, args.out)
                print("plots: " + ", ".join(str(p) for p in paths))
    report["wall_s"] = time.perf_counter() - started
    tables = [
        f"### {name} ({sc['concurrency']} concurrent conversations)\n\n{markdown_table(sc['results'])}"
        for name, sc in report["scenarios"].items()
    ]
    (args.out / "tables.md").write_text("\n".join(tables))
    path = args.out / "results.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path} ({report['wall_s']:.0f}s)")
    return 1 if failed else 0
