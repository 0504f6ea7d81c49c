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
pool (``bench.replay.infinite_cache_bound``). Target: canonicalization on >= 90 % of the bound for
every agent. The canonicalization cost on a 100k-token request comes from ``bench/canonical_cost.py``.

Run: ``python bench/canonical.py [--sessions 4] [--turns 8] [--ranks 2] [--date-mode day|move]``.
Prints a table, writes bench/out/canonical.json.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp

from bench.canonical_cost import main as canonical_cost_main
from bench.common import OUT_DIR, machine, write_json
from bench.replay import infinite_cache_bound, post_chat_stream
from bench.sim import SimConfig, start_fleet, stop_fleet
from bench.workload import make_tools, text_of
from proxy.app import create_app
from proxy.config import load_settings
from proxy.server import ServerThread

AGENTS = ("codex", "claude_code", "cline", "opencode", "openhands", "aider")
TARGET = 0.9
MIDNIGHT_TURN = 4  # the turn before which midnight passes, in session 0 of the date-in-system agents


@dataclass(frozen=True)
class Shape:
    """Sizes of the synthetic sessions (tokens are approximate: cl100k on code-ish words)."""

    system_tokens: int = 1_500
    tools: int = 10
    first_user_tokens: int = 400
    step_tokens: int = 250


Body = dict[str, Any]
Builder = Callable[[int, int, bool, Shape], list[Body]]


def _shuffled(rng: random.Random, items: list[Any]) -> list[Any]:
    out = list(items)
    rng.shuffle(out)
    return out


def _reserialized(tool: dict[str, Any]) -> dict[str, Any]:
    """The same tool with its envelope and schema keys in another order (as a re-serializer writes)."""
    fn = tool["function"]
    params = fn["parameters"]
    new_params = {"required": params["required"], "properties": params["properties"], "type": params["type"]}
    return {
        "function": {"parameters": new_params, "description": fn["description"], "name": fn["name"]},
        "type": "function",
    }


def _steps(rng: random.Random, session: int, turns: int, shape: Shape, names: list[str]) -> list[list[Body]]:
    """Per turn after the first: the assistant's tool call, its result and a short user nudge."""
    steps = []
    for t in range(1, turns):
        call_id = f"call_{session}_{t}"
        name = names[t % len(names)]
        steps.append(
            [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": json.dumps({"path": f"src/m{t}.py"})},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": call_id, "content": text_of(rng, shape.step_tokens)},
            ]
        )
    return steps


def _sequence(
    system_for: Callable[[int], list[Body]],
    first: list[Body],
    steps: list[list[Body]],
    tools_for: Callable[[int], list[Body] | None],
    user_for: Callable[[int], Body | None] = lambda t: None,
) -> list[Body]:
    """Turn t re-sends the history of turn t-1, the step's messages and (optionally) a new user message."""
    turns = []
    history = list(first)
    for t in range(len(steps) + 1):
        if t:
            history = history + steps[t - 1]
            extra = user_for(t)
            if extra is not None:
                history = [*history, extra]
        body: Body = {"model": "", "messages": system_for(t) + history}
        tools = tools_for(t)
        if tools is not None:
            body["tools"] = tools
        turns.append(copy.deepcopy(body))
    return turns


def _date(session: int, turn: int, drift: bool) -> int:
    """Day of the month: midnight passes before ``MIDNIGHT_TURN`` in session 0 (only with drift)."""
    return 4 if drift and session == 0 and turn >= MIDNIGHT_TURN else 3


class Agents:
    """Session builders: ``build(agent, session, turns, drift)`` -> the request bodies of its turns."""

    def __init__(self, shape: Shape, seed: int = 0) -> None:
        self.shape = shape
        rng = random.Random(seed)
        # One agent version: every session shares its system text and its built-in tools.
        self.system = {a: text_of(rng, shape.system_tokens) for a in AGENTS}
        self.tools = {a: make_tools(rng, shape.tools) for a in AGENTS}
        self.mcp = {a: make_tools(rng, 3) for a in AGENTS}
        self.seed = seed

    def build(self, agent: str, session: int, turns: int, drift: bool) -> list[Body]:
        return getattr(self, agent)(session, turns, drift)

    def _rng(self, agent: str, session: int) -> random.Random:
        return random.Random(f"{self.seed}/{agent}/{session}")

    def _first(self, rng: random.Random, session: int, prefix: str = "") -> list[Body]:
        return [
            {
                "role": "user",
                "content": prefix + f"Task {session}: " + text_of(rng, self.shape.first_user_tokens),
            }
        ]

    def codex(self, session: int, turns: int, drift: bool) -> list[Body]:
        rng = self._rng("codex", session)
        tools = self.tools["codex"] + self.mcp["codex"]
        env = (
            f"<environment_context>\n  <cwd>/work/repo{session}</cwd>\n  <shell>zsh</shell>\n"
            "</environment_context>\n"
        )
        first = self._first(rng, session, env)
        steps = _steps(rng, session, turns, self.shape, [t["function"]["name"] for t in tools])
        order = random.Random(f"order/{session}")

        def tools_for(t: int) -> list[Body]:
            if not drift:
                return tools
            return [_reserialized(x) if order.random() < 0.5 else x for x in _shuffled(order, tools)]

        return _sequence(
            lambda t: [{"role": "system", "content": self.system["codex"]}], first, steps, tools_for
        )

    def claude_code(self, session: int, turns: int, drift: bool) -> list[Body]:
        rng = self._rng("claude_code", session)
        noise = random.Random(f"cch/{session}")
        base, mcp = self.tools["claude_code"], self.mcp["claude_code"]
        first = self._first(rng, session)
        steps = _steps(rng, session, turns, self.shape, [t["function"]["name"] for t in base])
        env = (
            f"<env>\nWorking directory: /Users/dev/app{session}\nPlatform: darwin\n"
            "Today's date: 2025-11-03\n</env>"
        )

        def system_for(t: int) -> list[Body]:
            cch = f"{noise.getrandbits(20):05x}" if drift else "00000"
            billing = (
                f"x-anthropic-billing-header: cc_version=2.1.30.{cch[:3]}; cc_entrypoint=cli; cch={cch};"
            )
            parts = [billing, self.system["claude_code"], env]
            return [{"role": "system", "content": [{"type": "text", "text": p} for p in parts]}]

        def tools_for(t: int) -> list[Body]:
            if t < 2:
                return base
            if t < 5 or not drift:
                return base + mcp  # the MCP server connected before turn 2: a real change
            return base + [_reserialized(x) for x in reversed(mcp)]  # reconnected: other order and keys

        return _sequence(system_for, first, steps, tools_for)

    def cline(self, session: int, turns: int, drift: bool) -> list[Body]:
        rng = self._rng("cline", session)
        base, mcp = self.tools["cline"], self.mcp["cline"]
        first = self._first(rng, session)
        steps = _steps(rng, session, turns, self.shape, [t["function"]["name"] for t in base])

        def user_for(t: int) -> Body:
            when = f"11/3/2025, {9 + session}:{t:02d}:{(t * 17) % 60:02d} AM (Europe/Berlin, UTC+1:00)"
            return {
                "role": "user",
                "content": f"<environment_details>\n# Current Time\n{when}\n"
                f"# Context Window Usage\n{t * 3}%\n</environment_details>",
            }

        def tools_for(t: int) -> list[Body]:
            return base + (mcp[::-1] if drift and t >= 3 else mcp)

        return _sequence(
            lambda t: [{"role": "system", "content": self.system["cline"]}], first, steps, tools_for, user_for
        )

    def opencode(self, session: int, turns: int, drift: bool) -> list[Body]:
        rng = self._rng("opencode", session)
        base, mcp = self.tools["opencode"], self.mcp["opencode"]
        first = self._first(rng, session)
        steps = _steps(rng, session, turns, self.shape, [t["function"]["name"] for t in base])

        def system_for(t: int) -> list[Body]:
            day = _date(session, t, drift)
            env = (
                f"Here is some useful information about the environment you are running in:\n<env>\n"
                f"  Working directory: /home/dev/svc{session}\n  Platform: linux\n"
                f"  Today's date: {'Mon' if day == 3 else 'Tue'} Nov 0{day} 2025\n</env>"
            )
            return [
                {"role": "system", "content": self.system["opencode"]},
                {"role": "system", "content": env},
            ]

        def tools_for(t: int) -> list[Body]:
            return base + (mcp[1:] + mcp[:1] if drift and t >= 3 else mcp)  # restart: another order

        return _sequence(system_for, first, steps, tools_for)

    def openhands(self, session: int, turns: int, drift: bool) -> list[Body]:
        rng = self._rng("openhands", session)
        base, mcp = self.tools["openhands"], self.mcp["openhands"]
        runtime = (
            f"<RUNTIME_INFORMATION>\nHosts: http://localhost:5{session}234\n"
            "Today's date is 2025-11-03 (UTC).\n</RUNTIME_INFORMATION>\n"
        )
        first = self._first(rng, session, runtime)
        steps = _steps(rng, session, turns, self.shape, [t["function"]["name"] for t in base])

        def tools_for(t: int) -> list[Body]:
            return base + mcp + (mcp[:1] if drift and t >= 3 else [])  # fetch sent twice after a reconnect

        return _sequence(
            lambda t: [{"role": "system", "content": self.system["openhands"]}], first, steps, tools_for
        )

    def aider(self, session: int, turns: int, drift: bool) -> list[Body]:
        rng = self._rng("aider", session)
        repo_map = "Here are summaries of some files in my git repo:\n\n" + text_of(rng, 300)
        first = [
            {"role": "user", "content": repo_map},
            {"role": "assistant", "content": "Ok, I won't try and edit those files without asking first."},
            *self._first(rng, session),
        ]
        steps = [
            [
                {
                    "role": "assistant",
                    "content": "src/calc.py\n```\n<<<<<<< SEARCH\n" + text_of(rng, 80) + "\n=======\n",
                },
                {"role": "user", "content": text_of(rng, self.shape.step_tokens)},
            ]
            for _ in range(1, turns)
        ]

        def system_for(t: int) -> list[Body]:
            text = (
                self.system["aider"].replace("\n", "  \r\n")
                + f"\r\n- Platform: Linux\r\n- Current date: 2025-11-0{_date(session, t, drift)}\r\n"
            )
            return [{"role": "system", "content": text}]

        return _sequence(system_for, first, steps, lambda t: None)


async def _run_sessions(
    url: str, sessions: list[list[Body]], model: str, agent: str
) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) per request; sessions concurrently, turns in order."""
    out: list[tuple[int, int]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:

        async def run(index: int, turns: list[Body]) -> None:
            for body in turns:
                body = {**body, "model": model, "stream": True, "max_tokens": 8}
                body["stream_options"] = {"include_usage": True}
                result = await post_chat_stream(http, url, body, f"{agent}-{index}")
                out.append((result.prompt_tokens, result.cached_tokens))

        await asyncio.gather(*(run(i, s) for i, s in enumerate(sessions)))
    return out


def run_agent(
    agent: str, canonicalize: bool, args: argparse.Namespace, agents: Agents, sim: SimConfig
) -> float:
    """Fleet hit rate of one agent's sessions through prefixgate (canonicalization on or off)."""
    sessions = [agents.build(agent, s, args.turns, drift=True) for s in range(args.sessions)]
    fleet = start_fleet(args.ranks, sim)
    try:
        flags: dict[str, Any] = {"log_level": "warning", "no_canonicalize": not canonicalize}
        if args.date_mode != "day":
            flags["canonical"] = {"rules": {"volatile_date": {"mode": args.date_mode}}}
        settings = load_settings(flags=flags, backend_specs=[f"{r.name}={r.url}" for r in fleet], environ={})
        with ServerThread(create_app(settings)) as proxy:
            usage = asyncio.run(_run_sessions(proxy.url, sessions, sim.model, agent))
    finally:
        stop_fleet(fleet)
    prompt = sum(p for p, _ in usage)
    return sum(c for _, c in usage) / prompt if prompt else 0.0


def bound(agent: str, args: argparse.Namespace, agents: Agents, block_size: int) -> float:
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
    parser.add_argument("--agents", default=",".join(AGENTS), help="comma-separated agent shapes")
    parser.add_argument("--date-mode", choices=("day", "move"), default="day", help="volatile_date rule mode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cost-runs", type=int, default=100, help="runs of bench/canonical_cost.py (0: skip)"
    )
    args = parser.parse_args(argv)

    sim = replace(SimConfig(), time_scale=0.001, kv_tokens=262_144)
    agents = Agents(Shape(), args.seed)
    names = [a for a in args.agents.split(",") if a]
    print(
        f"canonicalization benchmark: {args.sessions} sessions x {args.turns} turns per agent, "
        f"{args.ranks} simulated ranks, volatile_date mode {args.date_mode}"
    )
    rows: dict[str, dict[str, float]] = {}
    for agent in names:
        off = run_agent(agent, False, args, agents, sim)
        on = run_agent(agent, True, args, agents, sim)
        b = bound(agent, args, agents, sim.block_size)
        rows[agent] = {"off": off, "on": on, "bound": b, "on_vs_bound": on / b if b else 0.0}
    print(f"\n{'agent':<13}{'canon off':>10}{'canon on':>10}{'bound':>8}{'on/bound':>10}")
    for agent, r in rows.items():
        mark = "" if r["on_vs_bound"] >= TARGET else "  < target"
        print(
            f"{agent:<13}{r['off']:>10.1%}{r['on']:>10.1%}{r['bound']:>8.1%}{r['on_vs_bound']:>10.1%}{mark}"
        )
    print(f"\nhit rate = cached / prompt tokens as the ranks reported them; target on/bound >= {TARGET:.0%}")

    cost: dict[str, Any] | None = None
    if args.cost_runs:
        print("\ncanonicalization cost (bench/canonical_cost.py):")
        canonical_cost_main(["--runs", str(args.cost_runs)])
        cost = json.loads((OUT_DIR / "canonical_cost.json").read_text())
    options = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    report = {
        "args": options,
        "machine": machine(),
        "target_on_vs_bound": TARGET,
        "agents": rows,
        "cost": cost,
    }
    path = write_json("canonical.json", report)
    print(f"wrote {path}")
    missed = [a for a, r in rows.items() if r["on_vs_bound"] < TARGET]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
