"""What a ``prefixgate bench`` run replays: the presets, the flags that override them, the sessions.

A ``Preset`` fixes the trace, how much of it, the scenarios, the simulated fleet (its ranks'
compute speeds among them) and the time compression; ``resolve`` applies the command's flags to
one, ``load_sessions`` reads the conversations it names and ``scenario_fleet`` sizes each
scenario. Scenarios are sized one of two ways (``Preset.sizing``):

- ``concurrency``: ``fits`` and ``over`` differ in how many conversations run at once
  (``fits_concurrency``, ``over_concurrency``) in front of ``kv_tokens`` pools;
- ``pressure``: every scenario runs ``over_concurrency`` conversations and differs only in memory:
  each rank's pool is sized so that the replay's mean working set is ``PRESSURES[scenario]`` x the
  fleet's pools (``bench/pressure.py``).

A preset with ``fleets`` (``seats``) runs cells instead: fleet x traffic shape x speed x pressure
(``bench/cells.py`` says what each is).

prefixgate runs with its defaults: its clocks learn the replay's pace.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.cells import FLEETS, SHAPES, plan_cell
from bench.pressure import mean_working_set, pool_for
from bench.sim import DEFAULT_KV_TOKENS
from bench.traces import CLAUDE_CODE_DIR, MOONCAKE_DIR, TraceSession, load_claude_code, load_mooncake


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
    #: The ranks' compute speeds to run (``SPEEDS``), each a dimension beside the scenarios.
    speeds: tuple[str, ...] = ("fast",)
    #: How scenarios differ: ``concurrency`` or ``pressure`` (see the module docstring).
    sizing: str = "concurrency"
    #: Fleets of the cells (``bench.cells.FLEETS``); empty: the scenarios above, on ``ranks`` ranks.
    fleets: tuple[str, ...] = ()
    #: Traffic shapes of the cells (``bench.cells.SHAPES``), with ``fleets``.
    shapes: tuple[str, ...] = ("whole",)
    #: Requests per session of the ``sessions`` shape.
    session_turns: int = 40
    #: The ``whole`` shape takes only conversations of at most this many requests; None: any.
    whole_turns: int | None = None
    #: Each request asks the trace's output length capped at this; None: ``max_tokens`` for all.
    max_output_tokens: int | None = None
    #: Longest wait (s) the client honours of a 429's Retry-After before its retry.
    max_retry_wait_s: float = 1.0


#: Prefill tokens per second of a simulated rank (before the sim's time compression): an H100-class
#: rank serving an ~8B model, and one a tenth as fast (a larger model, or a smaller GPU).
SPEEDS: dict[str, float] = {"fast": 20_000.0, "slow": 2_500.0}
#: Working set over the fleet's pools, per scenario, when scenarios are sized by pressure.
PRESSURES: dict[str, float] = {"fits": 0.5, "over": 1.25, "heavy": 1.9}


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
    # Issue 17's comparison: both compute speeds x three memory pressures, think times and the
    # ranks' time compressed 100x, the same 20 concurrent conversations throughout. Two ranks, so
    # that even at 1.9x a pool still holds a handful of sessions (234k tokens against sessions of
    # up to 100k), as a production pool does.
    "matrix": Preset(
        conversations=None,
        max_requests=None,
        scenarios=("fits", "over", "heavy"),
        over_concurrency=20,
        ranks=2,
        sim_time_scale=0.01,
        time_scale=0.01,
        speeds=("fast", "slow"),
        sizing="pressure",
    ),
    # Issue 45's cells: fleets (the seed's one rank of 8 seats; 2 ranks) x shapes (whole
    # conversations of at most 24 requests arriving over time, 8 at a time; sessions of at most
    # 40 requests starting together) x fast and slow ranks x pressures 0.5, 1.25 and 1.9 (mean
    # working set over the fleet's total pools: on the seed rank by how many sessions run at once,
    # on 2 ranks by the pools' size). The trace's output lengths, capped at 512, decode behind
    # prefill. A 429's Retry-After is honoured up to 60 s, as the openai SDK does. Think times and
    # the ranks' time compressed 200x alike (the matrix's 100x: --time-scale 0.01
    # --sim-time-scale 0.01, about 1.6x longer), so that one cell with 4 systems and 1 round takes
    # about 1-2 minutes on 2 cores (the slow, heavy cells the longest).
    "seats": Preset(
        conversations=None,
        max_requests=None,
        scenarios=("fits", "over", "heavy"),
        over_concurrency=8,
        ranks=2,
        sim_time_scale=0.005,
        time_scale=0.005,
        speeds=("fast", "slow"),
        sizing="pressure",
        fleets=("seed", "several"),
        shapes=("whole", "sessions"),
        max_output_tokens=512,
        max_retry_wait_s=60.0,
        whole_turns=24,
    ),
}


def resolve(args: argparse.Namespace) -> Preset:
    """``args.preset`` with every flag the command line gave in place of the preset's value."""
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
        "sizing",
        "session_turns",
        "whole_turns",
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
    if args.speeds:
        overrides["speeds"] = tuple(s.strip() for s in args.speeds.split(",") if s.strip())
    if args.fleets:
        overrides["fleets"] = _names(args.fleets, FLEETS, "fleets")
        overrides.setdefault("sizing", "pressure")
    if args.shapes:
        overrides["shapes"] = _names(args.shapes, SHAPES, "shapes")
    if args.max_output_tokens is not None:  # 0: the fixed --max-tokens for every request
        overrides["max_output_tokens"] = args.max_output_tokens or None
    if args.max_retry_wait is not None:
        overrides["max_retry_wait_s"] = args.max_retry_wait
    resolved = replace(preset, **overrides)
    if resolved.fleets and resolved.sizing != "pressure":
        raise SystemExit("--fleet cells are sized by pressure (--sizing pressure)")
    unknown = [s for s in resolved.speeds if s not in SPEEDS and not _is_number(s)]
    if unknown:
        raise SystemExit(f"unknown speeds {unknown}: {', '.join(SPEEDS)} or prefill tokens/s")
    if resolved.sizing == "pressure":
        odd = [s for s in resolved.scenarios if s not in PRESSURES and not _is_number(s.lstrip("x"))]
        if odd:
            raise SystemExit(f"unknown scenarios {odd}: {', '.join(PRESSURES)} or a pressure like x1.5")
    return resolved


def _names(text: str, known: Sequence[str] | dict[str, Any], what: str) -> tuple[str, ...]:
    """A comma-separated list of names, each one of ``known``."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(f"unknown {what} {unknown or text!r}: {', '.join(known)}")
    return names


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def prefill_rate(speed: str) -> float:
    """Prefill tokens/s of a speed name (``SPEEDS``) or a number."""
    return SPEEDS[speed] if speed in SPEEDS else float(speed)


def scenario_pressure(scenario: str) -> float:
    """The pressure a scenario aims at: ``PRESSURES``' or a number like ``x1.5``."""
    return PRESSURES[scenario] if scenario in PRESSURES else float(scenario.lstrip("x"))


@dataclass(frozen=True, slots=True)
class Cell:
    """One cell of a run: what is replayed (``sessions``, ``concurrency`` at once) in front of what."""

    name: str
    sessions: list[TraceSession]
    concurrency: int
    ranks: int
    kv_tokens: int
    prefill_rate: float
    block_size: int = 16
    max_num_seqs: int = 256
    pressure_aimed: float | None = None
    #: The mean working set over the pools as planned (cells with fleets).
    pressure_planned: float | None = None
    fleet: str | None = None
    shape: str | None = None


def preset_cells(preset: Preset, sessions: list[TraceSession]) -> list[Cell]:
    """The cells a preset runs, in order: its scenarios at each speed, or, with ``fleets``, every
    fleet x shape x speed x pressure (``bench.cells``)."""
    cells: list[Cell] = []
    if not preset.fleets:
        for speed in preset.speeds:
            for scenario in preset.scenarios:
                name = scenario if len(preset.speeds) == 1 else f"{speed}-{scenario}"
                concurrency, kv_tokens, pressure = scenario_fleet(preset, scenario, sessions, 16)
                cell = Cell(name, sessions, concurrency, preset.ranks, kv_tokens, prefill_rate(speed))
                cells.append(replace(cell, pressure_aimed=pressure))
        return cells
    for fleet in preset.fleets:
        for shape in preset.shapes:
            for speed in preset.speeds:
                for scenario in preset.scenarios:
                    pressure = scenario_pressure(scenario)
                    plan = plan_cell(
                        fleet,
                        shape,
                        pressure,
                        sessions,
                        ranks=preset.ranks,
                        concurrency=preset.over_concurrency,
                        session_turns=preset.session_turns,
                        time_scale=preset.time_scale,
                        whole_turns=preset.whole_turns,
                    )
                    cells.append(
                        Cell(
                            f"{fleet}-{shape}-{speed}-{scenario}",
                            plan.sessions,
                            plan.concurrency,
                            plan.ranks,
                            plan.kv_tokens,
                            prefill_rate(speed),
                            plan.block_size,
                            plan.max_num_seqs,
                            pressure,
                            plan.pressure_planned,
                            fleet,
                            shape,
                        )
                    )
    return cells


def scenario_fleet(
    preset: Preset, scenario: str, sessions: list[TraceSession], block_size: int
) -> tuple[int, int, float | None]:
    """(concurrency, each rank's pool in tokens, the pressure aimed at) of one scenario."""
    if preset.sizing != "pressure":
        concurrency = preset.fits_concurrency if scenario == "fits" else preset.over_concurrency
        return concurrency, preset.kv_tokens, None
    pressure = scenario_pressure(scenario)
    working_set = mean_working_set(sessions, preset.over_concurrency, preset.time_scale)
    return preset.over_concurrency, pool_for(working_set, pressure, preset.ranks, block_size), pressure


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
