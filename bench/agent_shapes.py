"""Synthetic multi-turn sessions of two coding-agent shapes, each with its real drift between requests.

The shapes follow ``specs/agent-requests.md``:

- ``codex``: MCP tools in a new (HashMap) order every request, envelopes re-serialized in another
  key order; environment in the first user message;
- ``claude_code``: a first system line ``x-anthropic-billing-header: ...; cch=...`` whose hash
  changes per request; ``<env>`` with a date; an MCP server connecting mid-session (new tools: a
  real change), reconnecting later with its tools in another order and schema keys re-serialized.

``Agents.build(agent, session, turns, drift)`` gives the request bodies of one session's turns; with
``drift=False`` the volatile fields stay frozen at the session's first request and the tools keep
their order (the bound's sessions). The demo's drift effect replays them.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.workload import make_tools, text_of

#: The agents a seed draws system text and tools for, in this order (the draws of the four that are
#: no longer built stay, so that a seed gives the same bodies it always gave).
AGENTS = ("codex", "claude_code", "cline", "opencode", "openhands", "aider")


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
