"""The three effects ``prefixgate demo`` shows, each as two arms (without and with prefixgate's part)
replayed on fresh simulated ranks: routing, canonicalization of drifting agents, admission when more
sessions run than the pools hold. Also the noise test that says when a latency difference is noise.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from bench.agent_shapes import Agents, Shape
from bench.common import percentile
from bench.replay import FixedBodies, ReplayResult, infinite_cache_bound, replay
from bench.sim import SimConfig, start_fleet, stop_fleet
from bench.workload import agent_sessions
from proxy.app import create_app
from proxy.config import load_settings
from proxy.server import ServerThread
from routing.policies import DEFAULT_POLICY

#: The drifting agents of effect 2 (``bench/agent_shapes.py`` says how each drifts).
DRIFTING = ("claude_code", "codex")


@dataclass(frozen=True)
class Arm:
    """One replay: its label and prefixgate's flags (``load_settings`` flags)."""

    label: str
    flags: dict[str, Any]


@dataclass(frozen=True)
class Effect:
    """Two arms over the same workload, on ``ranks`` fresh simulated ranks of ``kv_tokens`` each."""

    title: str
    ranks: int
    kv_tokens: int
    arms: tuple[Arm, Arm]
    #: Runs the workload against prefixgate's URL for the model the ranks serve.
    run: Callable[[str, str], ReplayResult]
    #: The requests the infinite-cache bound is computed on when not those sent (the drift-free
    #: ones: drift is what the bound leaves out); None: those sent.
    bound_requests: Callable[[], list[dict[str, Any]]] | None = None
    notes: tuple[str, ...] = field(default=())


def _plain(label: str) -> Arm:
    # what a fleet has without prefixgate: a plain load balancer, every stage off
    return Arm(label, {"policy": "round_robin", "no_admission": True, "no_canonicalize": True})


def effects(args: Any) -> list[Effect]:
    """The three effects at the demo's sizes (``args``: the command's flags)."""
    sessions, turns, seed = args.sessions, args.turns, args.seed
    agents = Agents(Shape(), seed)
    drifting = [agents.build(a, s, turns, drift=True) for a in DRIFTING for s in range(sessions // 2)]
    steady = [agents.build(a, s, turns, drift=False) for a in DRIFTING for s in range(sessions // 2)]
    crowd = 3 * sessions  # at their last turn their contexts add up to ~3x the two small pools

    def routing(url: str, model: str) -> ReplayResult:
        return asyncio.run(replay(url, agent_sessions(sessions, turns, seed=seed), model))

    def drift(url: str, model: str) -> ReplayResult:
        return asyncio.run(replay(url, [FixedBodies(f"agent-{i}", s) for i, s in enumerate(drifting)], model))

    def crowded(url: str, model: str) -> ReplayResult:
        work = agent_sessions(crowd, turns, system_tokens=500, first_turn_tokens=3_000, seed=seed)
        random.Random(seed).shuffle(work)
        return asyncio.run(replay(url, work, model))

    default = {"policy": DEFAULT_POLICY}
    return [
        Effect(
            f"routing: {sessions} sessions x {turns} turns of one agent on {args.ranks} ranks",
            args.ranks,
            args.kv_tokens,
            (_plain("round_robin"), Arm(default["policy"], default)),
            routing,
            notes=("round_robin: a plain load balancer (every stage of prefixgate off)",),
        ),
        Effect(
            f"drifting agents: {len(drifting)} {' and '.join(DRIFTING)} sessions, {args.ranks} ranks",
            args.ranks,
            args.kv_tokens,
            (Arm("canonicalization off", {"no_canonicalize": True}), Arm("canonicalization on", {})),
            drift,
            lambda: [steady[s][t] for t in range(turns) for s in range(len(steady))],
        ),
        Effect(
            f"more sessions than the pools: {crowd} sessions, 2 ranks of {args.small_kv_tokens:,} tokens",
            2,
            args.small_kv_tokens,
            (
                Arm("admission off", {"no_admission": True}),
                # prefixgate's defaults: its clocks learn the replay's pace from the traffic
                Arm("admission on", {}),
            ),
            crowded,
            notes=(
                "admission on: a session without a seat waits for one (the wait is in TTFT);",
                "past the rotation bound a quiet session's seat is rotated to it",
            ),
        ),
    ]


def run_arm(effect: Effect, arm: Arm, sim: SimConfig, bound: float | None = None) -> dict[str, Any]:
    """One arm on fresh ranks: the summary of what the ranks reported, the TTFTs and the bound
    (``bound``: the one an earlier round of this arm computed, the same requests: ~0.5 s saved)."""
    fleet = start_fleet(effect.ranks, replace(sim, kv_tokens=effect.kv_tokens))
    try:
        settings = load_settings(
            flags={"log_level": "warning", **arm.flags},
            backend_specs=[f"{r.name}={r.url}" for r in fleet],
            environ={},
        )
        with ServerThread(create_app(settings)) as proxy:
            result = effect.run(proxy.url, sim.model)
    finally:
        stop_fleet(fleet)
    summary = result.summary()
    if bound is None:
        requests = effect.bound_requests() if effect.bound_requests is not None else result.requests
        bound = infinite_cache_bound(requests, sim.block_size)
    summary["bound"] = bound
    summary["first_errors"] = result.errors[:3]
    summary["ttft_s"] = [t.ttft_s for t in result.turns]
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


def within_noise(
    a: list[float], b: list[float], q: float, rounds: int = 400, seed: int = 0
) -> tuple[bool, float, float]:
    """Whether the ``q`` percentiles (0-100) of two samples differ by no more than resampling them
    moves it: (the 95 % bootstrap interval of pct(b) - pct(a) holds 0, its low end, its high end)."""
    if len(a) < 2 or len(b) < 2:
        return True, float("nan"), float("nan")
    rng = random.Random(seed)
    diffs = sorted(
        percentile(rng.choices(b, k=len(b)), q) - percentile(rng.choices(a, k=len(a)), q)
        for _ in range(rounds)
    )
    low, high = diffs[int(0.025 * rounds)], diffs[int(0.975 * rounds) - 1]
    return low <= 0 <= high, low, high
