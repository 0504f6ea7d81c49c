"""What a ``prefixgate bench`` run replays: the presets, the flags that override them, the sessions.

A ``Preset`` fixes the trace, how much of it, the scenarios and their concurrency, the simulated
fleet and the time compression; ``resolve`` applies the command's flags to one, ``load_sessions``
reads the conversations it names and ``time_scaled_prefixgate_flags`` compresses prefixgate's own
clocks like the replay's.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench.sim.config import DEFAULT_KV_TOKENS
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
