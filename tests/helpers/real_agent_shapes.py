"""Multi-turn sessions of the real agents' prompts (``../shared/agents``), with the drifts seen in the field.

Each folder there holds one agent's real system prompt and tool definitions (``README.md`` there).
A session sends them every turn, then its own first user message and a growing history of tool calls
and results (``bench.agent_shapes.tool_steps``). With ``drift=True`` each session also has:

- its own order of every tool's parameter names (``properties`` keys at every depth and
  ``required``), as agents that build schemas from hash maps and MCP servers send them;
- its own tool order, and the last three tools (its "MCP" tools) reshuffled on every turn;
- its own clock in the system prompt where the agent puts one (the ``current_date_time``-style fields
  of ``volatile.json`` whose example has a time of day);
- a first system line ``x-anthropic-billing-header: ...; cch=...;`` whose hash changes per request.

With ``drift=False`` every session sends the files as they are, tools in their file order.
``RealAgents(folder).build(agent, session, turns, drift)`` gives one session's request bodies.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.agent_shapes import Body, Shape, sequence, tool_steps
from bench.workload import text_of

#: The shared agents folder, beside the project root.
SHARED_AGENTS = Path(__file__).resolve().parents[3] / "shared" / "agents"
#: A clock in ``volatile.json``'s examples: a date and a time of day.
_CLOCK = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
#: Tools at the end of the list reshuffled on every turn (MCP tools in HashMap order).
RESHUFFLED_TAIL = 3


def agent_names(folder: Path = SHARED_AGENTS) -> tuple[str, ...]:
    """The agents in ``folder`` (each a sub-folder with a system prompt), sorted."""
    return tuple(sorted(p.name for p in folder.iterdir() if (p / "system_prompt.txt").is_file()))


def shuffled_names(schema: Any, rng: random.Random) -> Any:
    """``schema`` with the keys of every ``properties`` map and every ``required`` list in a random order."""
    if isinstance(schema, list):
        return [shuffled_names(v, rng) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "properties" and isinstance(value, dict):
            names = list(value)
            rng.shuffle(names)
            value = {name: shuffled_names(value[name], rng) for name in names}
        elif key == "required" and isinstance(value, list):
            value = rng.sample(value, len(value))
        else:
            value = shuffled_names(value, rng)
        out[key] = value
    return out


def _replacing(old: str, new: str) -> Callable[[re.Match[str]], str]:
    """A ``re.sub`` replacement: the match with ``old`` replaced by ``new``."""
    return lambda m: m.group(0).replace(old, new)


class RealAgents:
    """Session builders over the agents of one ``../shared/agents`` folder."""

    def __init__(self, shape: Shape, seed: int = 0, folder: Path = SHARED_AGENTS) -> None:
        self.shape = shape
        self.seed = seed
        self.folder = folder

    def _system(self, agent: str) -> list[str]:
        path = self.folder / agent
        if (path / "system_messages.json").is_file():
            return list(json.loads((path / "system_messages.json").read_text(encoding="utf-8")))
        return [(path / "system_prompt.txt").read_text(encoding="utf-8")]

    def _tools(self, agent: str) -> list[Body]:
        return list(json.loads((self.folder / agent / "tools.json").read_text(encoding="utf-8")))

    def _clocks(self, agent: str) -> list[tuple[re.Pattern[str], str]]:
        """The system prompt's clock fields: their pattern and example (a date with a time of day)."""
        fields = json.loads((self.folder / agent / "volatile.json").read_text(encoding="utf-8"))["fields"]
        return [
            (re.compile(f["regex"]), f["example"])
            for f in fields
            if f["file"] == "system_prompt.txt" and _CLOCK.fullmatch(f["example"])
        ]

    def build(self, agent: str, session: int, turns: int, drift: bool) -> list[Body]:
        rng = random.Random(f"{self.seed}/{agent}/{session}")
        system, tools = self._system(agent), self._tools(agent)
        if drift:
            for pattern, example in self._clocks(agent):
                minute, second = rng.randrange(60), rng.randrange(60)
                clock = f"{example[:11]}{9 + session % 12:02d}:{minute:02d}:{second:02d}"
                system = [pattern.sub(_replacing(example, clock), text) for text in system]
            tools = [shuffled_names(t, rng) for t in tools]
            rng.shuffle(tools)
        task = f"Task {session}: " + text_of(rng, self.shape.first_user_tokens)
        first = [{"role": "user", "content": task}]
        names = [t["function"]["name"] for t in tools] or ["shell"]
        steps = tool_steps(rng, session, turns, self.shape, names)
        noise = random.Random(f"cch/{agent}/{session}")

        def system_for(t: int) -> list[Body]:
            texts = list(system)
            if drift:
                cch = f"{noise.getrandbits(20):05x}"
                texts[0] = f"x-anthropic-billing-header: cc_version=2.1.30.{cch[:3]}; cch={cch};\n{texts[0]}"
            return [{"role": "system", "content": text} for text in texts]

        def tools_for(t: int) -> list[Body] | None:
            if not tools:
                return None
            if not drift or len(tools) <= RESHUFFLED_TAIL:
                return tools
            tail = tools[-RESHUFFLED_TAIL:]
            turn_rng = random.Random(f"turn/{agent}/{session}/{t}")
            return tools[:-RESHUFFLED_TAIL] + turn_rng.sample(tail, len(tail))

        return sequence(system_for, first, steps, tools_for)
