"""Synthetic multi-turn sessions of six coding-agent shapes, each with its real drift between requests.

The shapes follow ``specs/agent-requests.md``; ``bench/canonical.py`` describes each agent's drift
and replays these sessions with canonicalization off and on. ``Agents.build(agent, session, turns,
drift)`` gives the request bodies of one session's turns; with ``drift=False`` the volatile fields
stay frozen at the session's first request and the tools keep their order (the bound's sessions).
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.workload import make_tools, text_of

AGENTS = ("codex", "claude_code", "cline", "opencode", "openhands", "aider")
MIDNIGHT_TURN = 4  # the turn before which midnight passes, in session 0 of the date-in-system agents


@dataclass(frozen=True)
class Shape:
    """Sizes of the synthetic sessions (tokens are approximate: cl100k on code-ish words)."""

    system_tokens: int = 1_500
    tools: int = 10
    first_user_tokens: int = 400
    step_tokens: int = 250


#: One chat message, tool or request body.
Body = dict[str, Any]


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


def tool_steps(
    rng: random.Random, session: int, turns: int, shape: Shape, names: list[str]
) -> list[list[Body]]:
    """Per turn after the first: the assistant's tool call, its result and a short user nudge."""
    steps: list[list[Body]] = []
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


def sequence(
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
        steps = tool_steps(rng, session, turns, self.shape, [t["function"]["name"] for t in tools])
        order = random.Random(f"order/{session}")

        def tools_for(t: int) -> list[Body]:
            if not drift:
                return tools
            return [_reserialized(x) if order.random() < 0.5 else x for x in _shuffled(order, tools)]

        return sequence(
            lambda t: [{"role": "system", "content": self.system["codex"]}], first, steps, tools_for
        )

    def claude_code(self, session: int, turns: int, drift: bool) -> list[Body]:
        rng = self._rng("claude_code", session)
        noise = random.Random(f"cch/{session}")
        base, mcp = self.tools["claude_code"], self.mcp["claude_code"]
        first = self._first(rng, session)
        steps = tool_steps(rng, session, turns, self.shape, [t["function"]["name"] for t in base])
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

        return sequence(system_for, first, steps, tools_for)

    def cline(self, session: int, turns: int, drift: bool) -> list[Body]:
        rng = self._rng("cline", session)
        base, mcp = self.tools["cline"], self.mcp["cline"]
        first = self._first(rng, session)
        steps = tool_steps(rng, session, turns, self.shape, [t["function"]["name"] for t in base])

        def user_for(t: int) -> Body:
            when = f"11/3/2025, {9 + session}:{t:02d}:{(t * 17) % 60:02d} AM (Europe/Berlin, UTC+1:00)"
            return {
                "role": "user",
                "content": f"<environment_details>\n# Current Time\n{when}\n"
                f"# Context Window Usage\n{t * 3}%\n</environment_details>",
            }

        def tools_for(t: int) -> list[Body]:
            return base + (mcp[::-1] if drift and t >= 3 else mcp)

        return sequence(
            lambda t: [{"role": "system", "content": self.system["cline"]}], first, steps, tools_for, user_for
        )

    def opencode(self, session: int, turns: int, drift: bool) -> list[Body]:
        rng = self._rng("opencode", session)
        base, mcp = self.tools["opencode"], self.mcp["opencode"]
        first = self._first(rng, session)
        steps = tool_steps(rng, session, turns, self.shape, [t["function"]["name"] for t in base])

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

        return sequence(system_for, first, steps, tools_for)

    def openhands(self, session: int, turns: int, drift: bool) -> list[Body]:
        rng = self._rng("openhands", session)
        base, mcp = self.tools["openhands"], self.mcp["openhands"]
        runtime = (
            f"<RUNTIME_INFORMATION>\nHosts: http://localhost:5{session}234\n"
            "Today's date is 2025-11-03 (UTC).\n</RUNTIME_INFORMATION>\n"
        )
        first = self._first(rng, session, runtime)
        steps = tool_steps(rng, session, turns, self.shape, [t["function"]["name"] for t in base])

        def tools_for(t: int) -> list[Body]:
            return base + mcp + (mcp[:1] if drift and t >= 3 else [])  # fetch sent twice after a reconnect

        return sequence(
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

        return sequence(system_for, first, steps, lambda t: None)
