"""``prefixgate demo``: what prefixgate does, three effects side by side, on simulated vLLM ranks.

Each effect replays the same built-in agent workload on fresh simulated ranks with prefixgate in
this process, without and with one of prefixgate's parts, in rounds (3 by default: one replay moves
from run to run on a busy machine).

1. routing: sessions of one agent through a plain round robin, then prefixgate's routing policy;
2. drifting agents: Claude Code and Codex sessions whose system prompt and tools drift between
   requests (a per-request billing hash, MCP tools reordered), canonicalization off, then on;
3. more sessions than the KV pools hold: admission off, then on (new sessions wait for room).

It prints, per arm, what the ranks reported: hit rate next to the workload's infinite-cache bound,
prefill (prompt tokens the ranks computed), time to first token, the replay's wall time, 429s and
errors; each figure the median of the rounds, with their min-max under it; and says which
differences are within noise (the two arms' min-max overlap). Needs nothing from outside the
repository; under a minute on two cores. Writes ``bench/out/demo.json`` (``effects``: every replay;
``results``: effect 1 by policy) and, with matplotlib, plots per effect.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.common import OUT_DIR, positive_count, write_json
from bench.demo_effects import Effect, effects, run_arm, within_noise
from bench.demo_rounds import FIGURES, combine, overlapping
from bench.sim import DEFAULT_KV_TOKENS, SimConfig

NAME = 22
HEADER = (
    f"{'':<{NAME}}{'hit rate':>8}{'bound':>7}{'prefill':>9}{'TTFT p50':>9}{'p99':>9}"
    f"{'wall':>6}{'429':>4}{'err':>4}"
)
#: Where each figure's column ends in HEADER: the spread line right-aligns its ranges there.
COLUMN_ENDS = {"hit_rate": 30, "prefill_tokens": 46, "ttft_p50_ms": 55, "ttft_p99_ms": 64, "wall_s": 70}
SPREAD_LABEL = "    min-max"
#: figure -> (scale, decimals, unit) of its range on the spread line, as the row shows it
SPREAD_FORMATS = {
    "hit_rate": (100, 1, "%"),
    "prefill_tokens": (1e-3, 0, "k"),
    "ttft_p50_ms": (1, 0, "ms"),
    "ttft_p99_ms": (1, 0, "ms"),
    "wall_s": (1, 1, "s"),
}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--ranks", type=int, default=4, help="simulated ranks of effects 1 and 2 (default 4)")
    parser.add_argument(
        "--sessions", type=int, default=12, help="agent sessions of effects 1 and 2 (default 12)"
    )
    parser.add_argument("--turns", type=int, default=6, help="turns per session (default 6)")
    parser.add_argument(
        "--kv-tokens",
        type=int,
        default=DEFAULT_KV_TOKENS,
        help="KV pool of each rank in effects 1 and 2, in tokens (default %(default)s)",
    )
    parser.add_argument(
        "--small-kv-tokens",
        type=int,
        default=40_000,
        help="KV pool of each of the 2 ranks of effect 3, in tokens (default %(default)s)",
    )
    parser.add_argument(
        "--time-scale", type=float, default=0.05, help="simulated-time factor of the ranks (default 0.05)"
    )
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument(
        "--out",
        type=Path,
        default=OUT_DIR,
        help="directory of demo.json and the plots (default: bench/out in the checkout)",
    )
    parser.add_argument(
        "--rounds",
        type=positive_count,
        default=3,
        help="replays of each arm; figures are their medians, with their min-max (default %(default)s)",
    )


def row(label: str, r: dict[str, Any]) -> str:
    """One replay's line (78 columns)."""
    return (
        f"  {label:<{NAME - 2}}{r['hit_rate']:>8.1%}{r['bound']:>7.1%}{r['prefill_tokens'] / 1000:>8.1f}k"
        f"{r['ttft_p50_ms']:>7.0f}ms{r['ttft_p99_ms']:>7.0f}ms{r['wall_s']:>5.1f}s{r['refused']:>4}"
        f"{r['errors'] - r['refused']:>4}"
    )


def spread_line(r: dict[str, Any]) -> str | None:
    """The min-max of each figure over the rounds, under its column (None for a single round)."""
    if len(r["rounds"]) < 2:
        return None
    ranges = {}
    for key, (scale, decimals, unit) in SPREAD_FORMATS.items():
        low, high = (f"{scale * v:.{decimals}f}" for v in r["spread"][key])
        ranges[key] = (low if low == high else f"{low}-{high}") + unit
    line = SPREAD_LABEL
    for key, text in ranges.items():
        # under its column when it fits there, else one space after the range before it
        line += " " * max(1, COLUMN_ENDS[key] - len(text) - len(line)) + text
    return line


def noise_line(without: dict[str, Any], with_: dict[str, Any]) -> str | None:
    """Which differences between the arms are within noise: over rounds, those whose min-max
    overlap; in a single round, a TTFT percentile whose 95 % bootstrap interval holds 0."""
    if min(len(without["rounds"]), len(with_["rounds"])) > 1:
        noisy = [
            name
            for key, name in FIGURES.items()
            if key != "prefill_tokens" and overlapping(without["spread"][key], with_["spread"][key])
        ]
        return f"  ~ within noise (min-max overlap): {', '.join(noisy)}" if noisy else None
    single = []
    for name, q in (("p50", 50), ("p99", 99)):
        inside, low, high = within_noise(without["ttft_s"], with_["ttft_s"], q)
        if inside:
            single.append(f"{name} {1000 * low:+.0f}..{1000 * high:+.0f} ms")
    if not single:
        return None
    return f"  ~ TTFT difference within noise (95%): {', '.join(single)}"


def run_effect(number: int, effect: Effect, sim: SimConfig, rounds: int) -> dict[str, Any]:
    """Both arms, alternating round by round (a machine busier in one stretch slows both)."""
    print(f"{number}. {effect.title}", flush=True)
    replays: dict[str, list[dict[str, Any]]] = {arm.label: [] for arm in effect.arms}
    for _ in range(rounds):
        for arm in effect.arms:
            earlier = replays[arm.label]
            earlier.append(run_arm(effect, arm, sim, earlier[0]["bound"] if earlier else None))
    arms = {label: combine(rs) for label, rs in replays.items()}
    for label, r in arms.items():
        print(row(label, r), flush=True)
        spread = spread_line(r)
        if spread:
            print(spread)
    without, with_ = arms.values()
    warning = noise_line(without, with_)
    for line in (*(f"  {note}" for note in effect.notes), warning):
        if line:
            print(line)
    return {"title": effect.title, "arms": arms}


def _figures(replay: dict[str, Any]) -> dict[str, Any]:
    """A replay's summary as demo.json keeps it (not its per-request lists)."""
    return {k: v for k, v in replay.items() if k not in ("turns", "ttft_s", "pooled_ttft_s")}


def shown(path: Path) -> str:
    """``path`` relative to the working directory when it is under it (shorter on screen)."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _plots(results: list[dict[str, Any]], out: Path) -> None:
    """Hit rate over the replay, prefill and TTFT CDF per effect as PNGs, when matplotlib is there."""
    try:
        from bench.plots import write_plots

        paths = []
        for number, effect in enumerate(results, 1):
            arms = effect["arms"]
            bound = next(iter(arms.values()))["bound"]
            paths += write_plots(f"demo-{number}", arms, bound, out / "demo")
    except RuntimeError:  # matplotlib missing: the table above is the result
        print("no plots: matplotlib is not installed (in a checkout: pip install -e '.[bench]')")
        return
    print(f"plots: {shown(out / 'demo')}/demo-N_*.png ({len(paths)} files)")


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    # prefixgate runs in this process: its operator log (a pool overrun in effect 3, by design)
    # would interleave with the table
    logging.getLogger("prefixgate").setLevel(logging.ERROR)
    sim = replace(SimConfig(), time_scale=args.time_scale)
    print("prefixgate demo: each effect replays one workload on fresh simulated vLLM ranks,")
    print("without and with one part of prefixgate (as the ranks reported it), in")
    if args.rounds > 1:
        print(f"{args.rounds} rounds: each figure is their median, with their min-max under it.\n")
    else:
        print("one round (with --rounds 3, each figure is the median of 3, with their min-max).\n")
    print(HEADER)
    results = []
    for number, effect in enumerate(effects(args), 1):
        results.append(run_effect(number, effect, sim, args.rounds))
    print(
        "\nhit rate: prompt tokens the ranks found in their prefix cache, of those sent"
        "\nbound: the same requests on one rank with an unlimited KV pool (the best case)"
        "\nprefill: prompt tokens the ranks had to compute, in thousands (less GPU work)"
        "\nTTFT: time to first token as the client saw it; wall: the whole replay"
    )
    options = {
        k: str(v) if isinstance(v, Path) else v
        for k, v in vars(args).items()
        if k not in ("handler", "command_parser")
    }
    report = [
        {"title": e["title"], "arms": {label: _figures(r) for label, r in e["arms"].items()}} for e in results
    ]
    # "results": the routing effect by policy, as the demo's JSON has always had it
    routing = report[0]["arms"]
    path = write_json("demo.json", {"args": options, "results": routing, "effects": report}, args.out)
    print(f"wrote {shown(path)}")
    _plots(results, args.out)
    print(f"done in {time.perf_counter() - started:.0f} s")
    failed = [
        (e["title"], label, r)
        for e in results
        for label, r in e["arms"].items()
        if r["errors"] > r["refused"]
    ]
    for title, label, r in failed:
        print(f"errors in {title} / {label}: {r['first_errors']}", file=sys.stderr)
    return 1 if failed else 0
