"""Synthetic coding-agent sessions: the shape of real agent traffic, built in, no data files needed.

Every session of one agent kind shares the same system prompt and tool list (as sessions of one
agent version do); each turn re-sends the whole history and appends a user message (a tool result
or an instruction) after the assistant's previous answer. Text is deterministic from the seed.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

WORDS = [
    "def",
    "return",
    "class",
    "import",
    "self",
    "value",
    "index",
    "buffer",
    "request",
    "session",
    "token",
    "block",
    "cache",
    "prefix",
    "router",
    "rank",
    "pool",
    "config",
    "error",
    "retry",
    "stream",
    "chunk",
    "header",
    "parse",
    "render",
    "hash",
    "route",
    "admit",
    "forward",
    "observe",
    "update",
    "list",
    "dict",
    "string",
    "int",
    "float",
    "none",
    "true",
    "false",
    "async",
    "await",
    "yield",
    "file",
    "path",
    "line",
    "diff",
    "patch",
    "test",
    "assert",
    "expect",
    "result",
    "output",
    "input",
    "context",
    "window",
    "agent",
    "tool",
    "call",
    "argument",
    "schema",
    "property",
    "required",
    "description",
    "function",
    "name",
    "type",
    "object",
    "array",
]


def text_of(rng: random.Random, approx_tokens: int) -> str:
    """About ``approx_tokens`` tokens of code-ish text (cl100k: ~1.3 tokens per word here)."""
    words = max(1, int(approx_tokens / 1.3))
    lines = []
    for start in range(0, words, 12):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(min(12, words - start))))
    return "\n".join(lines)


def make_tools(rng: random.Random, count: int) -> list[dict[str, Any]]:
    tools = []
    for i in range(count):
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": f"tool_{i}_{rng.choice(WORDS)}",
                    "description": text_of(rng, 60),
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "path": {"type": "string", "description": text_of(rng, 10)},
                            "content": {"type": "string", "description": text_of(rng, 10)},
                        },
                        "required": ["path"],
                    },
                },
            }
        )
    return tools


@dataclass
class Session:
    """One agent conversation: the head every turn re-sends, and the new user message per turn."""

    key: str
    system: str
    tools: list[dict[str, Any]]
    user_turns: list[str]
    max_tokens: int = 32
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def turns(self) -> int:
        return len(self.user_turns)

    def request(self, turn: int, model: str) -> dict[str, Any]:
        """The streamed chat request of ``turn``; call ``answer`` with the reply before the next turn."""
        if turn == 0:
            self.messages = [{"role": "system", "content": self.system}]
        self.messages.append({"role": "user", "content": self.user_turns[turn]})
        return {
            "model": model,
            "messages": list(self.messages),
            "tools": self.tools,
            "max_tokens": self.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def answer(self, content: str) -> None:
        self.messages.append({"role": "assistant", "content": content})


def agent_sessions(
    sessions: int = 8,
    turns: int = 6,
    system_tokens: int = 2_000,
    tool_count: int = 12,
    first_turn_tokens: int = 1_500,
    turn_tokens: int = 400,
    seed: int = 0,
) -> list[Session]:
    """``sessions`` conversations of one agent kind (shared system prompt and tools)."""
    rng = random.Random(seed)
    system = "You are a coding agent working in a repository.\n" + text_of(rng, system_tokens)
    tools = make_tools(rng, tool_count)
    out = []
    for s in range(sessions):
        user_turns = [f"Task {s}: " + text_of(rng, first_turn_tokens)]
        user_turns += [f"Tool result {s}.{t}:\n" + text_of(rng, turn_tokens) for t in range(1, turns)]
        out.append(Session(key=f"session-{seed}-{s}", system=system, tools=tools, user_turns=user_turns))
    return out
