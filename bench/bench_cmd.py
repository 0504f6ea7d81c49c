"""``prefixgate bench``: replay agent traces through prefixgate's policies and peer routers, side by side.

Every system gets the same trace, the same seed and a fresh simulated fleet (in a subprocess);
systems run one after the other. Everything measured comes from what the ranks report (their
``usage`` and ``/metrics``), the client's timings and the OS's CPU time of the system's process;
``/ RR`` is prefill against ``plain round_robin`` (prefixgate with every stage off: a plain load
balancer). After each scenario a verdict says, per measure, whether prefixgate is ahead of every
peer and whether it met issue 17's targets. Presets:

  small   Claude Code, 2 ranks x 181,777 tokens, 10 conversations x 6 requests, scenario over:
          under 2 minutes on 2 cores
  full    Claude Code, 4 ranks x 181,777 tokens, every conversation whose requests all stay under
          100k tokens (40, 806 requests), scenarios fits (6 concurrent) and over (20 concurrent):
          about 7 minutes on 2 cores
  matrix  the same 40 conversations, 20 at a time, 2 ranks, fast and slow ranks x pressures fits,
          over (1.25x) and heavy (1.9x), time compressed 100x: about 25 minutes with the peers
  seats   issue 45's cells, named FLEET-SHAPE-SPEED-SCENARIO: fleets x shapes x speeds (fast,
          slow) x pressures (fits 0.5x, over 1.25x, heavy 1.9x), outputs of the trace's length up
          to 512 tokens, time compressed 200x: 1-2 minutes per cell with 4 systems and 1 round

The method, what each figure means and the current results: docs/benchmarks.md. Output: a table
per scenario, ``results.json`` and PNG plots in ``--out``. The traces are read from
``../shared/traces`` (``--traces``); peers come from ``bench/peers/install.sh``, and without them
only prefixgate's policies run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.bench_presets import (
    PRESETS,
    Cell,
    load_sessions,
    preset_cells,
    resolve,
)
from bench.bench_tables import markdown_table, print_table
from bench.common import positive_count
from bench.cpu_tier_cell import add_cpu_tier_option, cpu_tier_prefixgate_flags, with_cpu_tier
from bench.plots import plots_available
from bench.replay import TraceReplayConfig
from bench.rounds import combine_all, rotation
from bench.sim import DEFAULT_KV_TOKENS
from bench.traces import TracesMissing, reuse_breakdown, trace_block_reuse
from bench.verdict import verdict, verdict_lines

if TYPE_CHECKING:  # psutil (the ``bench`` extra) is imported only when a benchmark runs
    from bench.systems import SystemSpec

DEFAULT_OUT = Path(__file__).resolve().parent / "out" / "bench"


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
    parser.add_argument(
        "--scenarios", default=None, help="fits,over[,heavy] or a pressure like x1.5 (default: the preset's)"
    )
    parser.add_argument(
        "--sizing",
        choices=["concurrency", "pressure"],
        default=None,
        help="scenarios differ by concurrency, or by pools sized for a memory pressure (default: preset's)",
    )
    parser.add_argument("--speeds", default=None, help="ranks' compute speeds: fast,slow or prefill tokens/s")
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
        "--max-output-tokens",
        type=int,
        default=None,
        help="each request asks the trace's own output length capped at N (seats: 512); 0: --max-tokens",
    )
    parser.add_argument(
        "--fleet",
        "--fleets",
        dest="fleets",
        default=None,
        help="cells on these fleets: seed (1 rank, 181,777 tokens in 256-token blocks, 8 seats), "
        "several (--ranks ranks); comma-separated (default: the preset's; seats: seed,several)",
    )
    parser.add_argument(
        "--shapes",
        "--shape",
        dest="shapes",
        default=None,
        help="traffic shapes with --fleet: whole (conversations arriving over time), sessions "
        "(capped sessions starting together); comma-separated (seats: whole,sessions)",
    )
    parser.add_argument(
        "--session-turns", type=int, default=None, help="requests per session of the sessions shape (40)"
    )
    parser.add_argument(
        "--whole-turns",
        type=int,
        default=None,
        help="the whole shape takes only conversations of at most N requests, uncut (seats: 24)",
    )
    parser.add_argument(
        "--max-retry-wait",
        type=float,
        default=None,
        help="longest Retry-After (s) the client honours before retrying a 429 (default 1; seats: 60)",
    )
    parser.add_argument(
        "--systems",
        default=None,
        help="comma-separated system names (default: plain round robin, every prefixgate policy and "
        "every peer); plain:round_robin (a plain load balancer: prefixgate with every stage off, the "
        "baseline of '/ RR'), prefixgate:<policy>, prefixgate:<policy>:<serve flags> (side by side "
        "with other settings), prefixgate@<source tree>:<policy>[:<serve flags>] (another commit's "
        "worktree, side by side with this one), 'sglang cache_aware', 'vllm-router cache_aware', "
        "'vllm-router consistent_hash'",
    )
    parser.add_argument("--no-peers", action="store_true", help="only prefixgate's policies")
    parser.add_argument(
        "--prefixgate-args", default="", help="extra flags for prefixgate serve, e.g. '--no-admission'"
    )
    parser.add_argument("--seed", type=int, default=0, help="conversation order and block text seed")
    parser.add_argument(
        "--rounds",
        type=positive_count,
        default=1,
        help="run every system N times, in a rotated order, and report each figure's median "
        "(errors and 429s: the worst round's); default 1",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="output folder (default bench/out/bench)"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    add_cpu_tier_option(parser)


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


def select_systems(args: argparse.Namespace) -> tuple[list[SystemSpec], list[str]]:
    """The systems to run, and notes on what was left out and why."""
    from bench import peers
    from bench.systems import PLAIN_ROUND_ROBIN, SystemSpec, peer_systems, prefixgate_systems

    notes: list[str] = []
    systems = [PLAIN_ROUND_ROBIN, *prefixgate_systems(available_policies())]
    if not args.no_peers:
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
        for w in wanted:  # prefixgate[@TREE]:POLICY[:FLAGS], e.g. 'prefixgate:prefix_affinity:--no-admission'
            kind, _, rest = w.partition(":")
            policy, _, flags = rest.partition(":")
            prefixgate, _, tree = kind.partition("@")
            if prefixgate != "prefixgate" or f"prefixgate:{policy}" not in by_name or not (flags or tree):
                continue
            extra = tuple(shlex.split(flags))
            root = Path(tree).resolve() if tree else None
            name = " ".join(p for p in (f"prefixgate{'@' + root.name if root else ''}", policy, flags) if p)
            by_name[w] = SystemSpec(name, "prefixgate", policy, args=extra, root=root)
        unknown = [w for w in wanted if w not in by_name]
        if unknown:
            raise SystemExit(f"unknown or unavailable systems: {unknown}; available: {sorted(by_name)}")
        systems = list(dict.fromkeys(by_name[w] for w in wanted))
    return systems, notes


def cell_title(cell: Cell) -> str:
    """What a cell ran, for its table's title."""
    at_once = (
        f"{len(cell.sessions)} sessions starting together"
        if cell.shape == "sessions"
        else f"{cell.concurrency} concurrent conversations"
        + (f" of {len(cell.sessions)}" if cell.shape == "whole" else "")
    )
    fleet = f"{cell.ranks} rank{'' if cell.ranks == 1 else 's'} x {cell.kv_tokens:,} KV tokens"
    if cell.fleet is not None:
        fleet += f" in {cell.block_size}-token blocks, {cell.max_num_seqs} seats"
    pressure = f", pressure {cell.pressure_planned:.2f}x planned" if cell.pressure_planned is not None else ""
    return f"{at_once}, {fleet}, prefill {cell.prefill_rate:,.0f} tokens/s{pressure}"


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
    from bench.bench_run import run_cell, write_cell_plots
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
    if not args.no_plots and not plots_available():
        # said now, not after the first scenario's minutes of replay: a run still gives its tables
        print(
            "prefixgate bench: no plots (matplotlib is not installed: pip install 'prefixgate[bench]', "
            "or pass --no-plots); the tables and the JSON report are written",
            file=sys.stderr,
        )
        args.no_plots = True
    all_sessions = [s for top in sessions for s in top.all_sessions()]
    n_requests = sum(len(s.requests) for s in all_sessions)
    sizes = (
        f"pools sized for {', '.join(preset.scenarios)}"
        if preset.sizing == "pressure"
        else f"{preset.kv_tokens:,} KV tokens"
    )
    fleets = (
        f"fleets {', '.join(preset.fleets)} x shapes {', '.join(preset.shapes)} "
        f"x {', '.join(preset.scenarios)}"
        if preset.fleets
        else f"{preset.ranks} ranks x {sizes}"
    )
    print(
        f"prefixgate bench: {preset.trace}, {len(sessions)} conversations "
        f"({len(all_sessions)} sessions counting sub-agents, {n_requests} requests, "
        f"trace block reuse {trace_block_reuse(all_sessions):.3f}); "
        f"{fleets}; speeds {', '.join(preset.speeds)}; "
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
        "rounds": args.rounds,
        "machine": {
            "cpus": os.cpu_count(),
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
    # prefixgate's defaults: its clocks learn the replay's pace
    prefixgate_args = shlex.split(args.prefixgate_args) + cpu_tier_prefixgate_flags(args.cpu_tier)
    report["prefixgate_args"] = prefixgate_args
    report["prefixgate_root"] = str(Path(__file__).resolve().parents[1])
    report["git_head"] = _git_head()
    started = time.perf_counter()
    failed = False
    for cell in preset_cells(preset, sessions):
        fleet = FleetConfig(
            ranks=cell.ranks,
            kv_tokens=cell.kv_tokens,
            time_scale=preset.sim_time_scale,
            block_size=cell.block_size,
            prefill_rate=cell.prefill_rate,
            max_num_seqs=cell.max_num_seqs,
            report_timing=True,
        )
        fleet = with_cpu_tier(fleet, args.cpu_tier)
        replay_config = TraceReplayConfig(
            model=fleet.model,
            concurrency=cell.concurrency,
            time_scale=preset.time_scale,
            max_tokens=preset.max_tokens,
            max_output_tokens=preset.max_output_tokens,
            block_tokens=block_tokens,
            kv_block_size=fleet.block_size,
            seed=args.seed,
            max_retry_wait_s=preset.max_retry_wait_s,
        )
        cell_requests = sum(len(s.requests) for top in cell.sessions for s in top.all_sessions())
        rounds: list[dict[str, dict[str, Any]]] = []
        for index in range(args.rounds):
            order = rotation(systems, index)
            found_round, scenario_failed = run_cell(
                cell.name,
                order,
                cell.sessions,
                fleet,
                replay_config,
                cell_requests,
                prefixgate_args,
                args.out,
            )
            rounds.append(found_round)
            failed = failed or scenario_failed
        results = rounds[0] if len(rounds) == 1 else combine_all(rounds)
        title = f"{cell.name} ({cell_title(cell)})"
        print_table(title, results, notes)
        found = verdict(cell.name, results)
        for line in verdict_lines(found) if found is not None else ():
            print(line)
        report["scenarios"][cell.name] = {
            "title": cell_title(cell),
            "concurrency": cell.concurrency,
            "kv_tokens": cell.kv_tokens,
            "ranks": cell.ranks,
            "block_size": cell.block_size,
            "max_num_seqs": cell.max_num_seqs,
            "fleet": cell.fleet,
            "shape": cell.shape,
            "sessions": len(cell.sessions),
            "requests": cell_requests,
            "prefill_rate": cell.prefill_rate,
            "pressure_aimed": cell.pressure_aimed,
            "pressure_planned": cell.pressure_planned,
            "results": results,
            "verdict": found,
        }
        if not args.no_plots:
            write_cell_plots(cell.name, results, args.out)
    report["wall_s"] = time.perf_counter() - started
    tables = [
        f"### {name} ({sc['title']})\n\n{markdown_table(sc['results'])}\n"
        + "".join(f"- {line}\n" for line in (verdict_lines(sc["verdict"]) if sc["verdict"] else ()))
        for name, sc in report["scenarios"].items()
    ]
    (args.out / "tables.md").write_text("\n".join(tables))
    path = args.out / "results.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path} ({report['wall_s']:.0f}s)")
    return 1 if failed else 0
