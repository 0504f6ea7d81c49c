"""Fleet hit rate with canonicalization off vs on, per agent shape, next to the content-identical bound.

Synthetic multi-turn sessions of six agent shapes (``specs/agent-requests.md``), each with its real
drift between requests:

- ``codex``: MCP tools in a new (HashMap) order every request, envelopes re-serialized in another key
  order; environment in the first user message;
- ``claude_code``: a first system line ``x-anthropic-billing-header: ...; cch=...`` whose hash changes
  per request; ``<env>`` with today's date; an MCP server connecting mid-session (new tools: a real
  change), reconnecting later with its tools in another order and schema keys re-serialized;
- ``cline``: the current time to the second in every new user message (user side); MCP tools
  rediscovered in another order mid-session;
- ``opencode``: ``Today's date: <toDateString()>`` in a system message, midnight passing in one
  session; MCP tools in another order after a restart;
- ``openhands``: date and ports in the first user message; the MCP fetch tool sent twice after a
  reconnect;
- ``aider``: ``Current date`` in the system prompt (CRLF line ends, trailing spaces), midnight passing
  in one session; a repo map before the history.

Each (agent, canonicalization off/on) runs on a fresh fleet of simulated vLLM ranks behind prefixgate
(default routing policy); sessions run concurrently, their turns in order. Hit rate = cached tokens /
prompt tokens as the ranks reported them. The bound: the same sessions without the drift (volatile
fields frozen at the session's first request, stable tool order), on one rank with an unlimited
pool (``bench.replay.infinite_cache_bound``). Beside it, the same sessions without the drift through
prefixgate on the same fleet shape (``no drift``): what the drift still costs once canonicalized.
Targets: canonicalization on >= 90 % of the bound and >= 98 % of no drift for every agent. The
canonicalization cost on a 100k-token request comes from ``bench/canonical_cost.py``.

``--real``: the agents of ``../shared/agents`` instead (their real system prompts and tools, with
per-session parameter order, per-session tool order, a per-turn reshuffle, a per-session clock and a
per-request attribution line: ``bench.real_agent_shapes``), written to canonical_real.json.
``--disable-rule NAME`` runs with a canonicalization rule off (what it is worth).

Run: ``python -m bench.canonical [--sessions 4] [--turns 8] [--ranks 2] [--date-mode day|move]
[--real] [--disable-rule NAME]``. Prints a table, writes bench/out/canonical.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import replace
from typing import Any, Protocol

from bench.agent_shapes import AGENTS, Agents, Body, Shape
from bench.body_replay import replay_bodies
from bench.canonical_cost import main as canonical_cost_main
from bench.common import OUT_DIR, machine, write_json
from bench.real_agent_shapes import SHARED_AGENTS, RealAgents, agent_names
from bench.replay import infinite_cache_bound
from bench.sim import SimConfig, start_fleet, stop_fleet
from proxy.app import create_app
from proxy.config import load_settings
from proxy.server import ServerThread

TARGET = 0.9
#: Drifting sessions canonicalized against the same sessions without drift, both through prefixgate.
NO_DRIFT_TARGET = 0.98


class SessionBuilder(Protocol):
    """Builds one session's request bodies (``Agents``, ``RealAgents``)."""

    def build(self, agent: str, session: int, turns: int, drift: bool) -> list[Body]: ...


def run_agent(
    agent: str,
    canonicalize: bool,
    args: argparse.Namespace,
    agents: SessionBuilder,
    sim: SimConfig,
    drift: bool = True,
) -> float:
    """Fleet hit rate of one agent's sessions through prefixgate (canonicalization on or off)."""
    sessions = [agents.build(agent, s, args.turns, drift=drift) for s in range(args.sessions)]
    fleet = start_fleet(args.ranks, sim)
    try:
        flags: dict[str, Any] = {"log_level": "warning", "no_canonicalize": not canonicalize}
        rules: dict[str, Any] = {name: {"enabled": False} for name in args.disable_rule}
        if args.date_mode != "day":
            rules["volatile_date"] = {"mode": args.date_mode}
        if rules:
            flags["canonical"] = {"rules": rules}
        settings = load_settings(flags=flags, backend_specs=[f"{r.name}={r.url}" for r in fleet], environ={})
        with ServerThread(create_app(settings)) as proxy:
            result = asyncio.run(replay_bodies(proxy.url, sessions, sim.model, agent))
    finally:
        stop_fleet(fleet)
    if result.errors:
        raise RuntimeError(f"{agent}: {result.errors[0]}")
    return result.summary()["hit_rate"]


def bound(agent: str, args: argparse.Namespace, agents: SessionBuilder, block_size: int) -> float:
    """Hit rate of the drift-free sessions on one unlimited rank, turns interleaved across sessions."""
    sessions = [agents.build(agent, s, args.turns, drift=False) for s in range(args.sessions)]
    ordered = [sessions[s][t] for t in range(args.turns) for s in range(args.sessions)]
    return infinite_cache_bound(ordered, block_size)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4, help="sessions per agent (default 4)")
    parser.add_argument("--turns", type=int, default=8, help="turns per session (default 8)")
    parser.add_argument("--ranks", type=int, default=2, help="simulated vLLM ranks (default 2)")
    parser.add_argument("--agents", default=None, help="comma-separated agent shapes (default: all)")
    parser.add_argument("--real", action="store_true", help=f"the real agents' prompts in {SHARED_AGENTS}")
    parser.add_argument(
        "--disable-rule", action="append", default=[], metavar="NAME", help="turn this rule off"
    )
    parser.add_argument("--date-mode", choices=("day", "move"), default="day", help="volatile_date rule mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cost-runs", type=int, default=100, help="runs of bench/canonical_cost.py (0: skip)"
    )
    args = parser.parse_args(argv)

    sim = replace(SimConfig(), time_scale=0.001, kv_tokens=262_144)
    agents: SessionBuilder
    if args.real:
        if not SHARED_AGENTS.is_dir():
            print(f"real agent prompts not found at {SHARED_AGENTS}", file=sys.stderr)
            return 2
        agents, known = RealAgents(Shape(), args.seed), agent_names()
    else:
        agents, known = Agents(Shape(), args.seed), AGENTS
    names = [a for a in (args.agents or ",".join(known)).split(",") if a]
    print(
        f"canonicalization benchmark: {args.sessions} sessions x {args.turns} turns per agent, "
        f"{args.ranks} simulated ranks, volatile_date mode {args.date_mode}"
        + (f", real prompts of {SHARED_AGENTS}" if args.real else "")
        + (f", rules off: {','.join(args.disable_rule)}" if args.disable_rule else "")
    )
    rows: dict[str, dict[str, float]] = {}
    for agent in names:
        off = run_agent(agent, False, args, agents, sim)
        on = run_agent(agent, True, args, agents, sim)
        still = run_agent(agent, True, args, agents, sim, drift=False)
        b = bound(agent, args, agents, sim.block_size)
        rows[agent] = {
            "off": off,
            "on": on,
            "no_drift": still,
            "on_vs_no_drift": on / still if still else 0.0,
            "bound": b,
            "on_vs_bound": on / b if b else 0.0,
        }
    print(
        f"\n{'agent':<13}{'canon off':>10}{'canon on':>10}{'no drift':>10}{'on/no drift':>13}"
        f"{'bound':>8}{'on/bound':>10}"
    )
    for agent, r in rows.items():
        mark = "" if _met(r) else "  < target"
        print(
            f"{agent:<13}{r['off']:>10.1%}{r['on']:>10.1%}{r['no_drift']:>10.1%}{r['on_vs_no_drift']:>13.1%}"
            f"{r['bound']:>8.1%}{r['on_vs_bound']:>10.1%}{mark}"
        )
    print(
        "\nhit rate = cached / prompt tokens as the ranks reported them; targets on/bound >= "
        f"{TARGET:.0%}, on/no drift >= {NO_DRIFT_TARGET:.0%}"
    )

    cost: dict[str, Any] | None = None
    if args.cost_runs:
        print("\ncanonicalization cost (bench/canonical_cost.py):")
        canonical_cost_main(["--runs", str(args.cost_runs)])
        cost = json.loads((OUT_DIR / "canonical_cost.json").read_text())
    options = {k: v for k, v in vars(args).items() if k != "handler" and not k.startswith("_")}
    report = {
        "args": options,
        "machine": machine(),
        "target_on_vs_bound": TARGET,
        "target_on_vs_no_drift": NO_DRIFT_TARGET,
        "agents": rows,
        "cost": cost,
    }
    path = write_json("canonical_real.json" if args.real else "canonical.json", report)
    print(f"wrote {path}")
    missed = [a for a, r in rows.items() if not _met(r)]
    return 1 if missed else 0


def _met(row: dict[str, float]) -> bool:
    return row["on_vs_bound"] >= TARGET and row["on_vs_no_drift"] >= NO_DRIFT_TARGET


if __name__ == "__main__":
    sys.exit(main())
