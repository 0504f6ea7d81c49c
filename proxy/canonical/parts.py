"""Named parts of a chat request, for the prefix-break explainer: "which part differs".

The order is the order in which a chat template lays the parts out in the prompt for the simulated
model (``tokenization.tiktoken_tokenizer``) and most Qwen-style templates: the leading system
messages, then the tools, then the other messages. Each part carries a digest of its exact bytes
(key order included, as that reaches the tokens), so two turns can be compared part by part without
re-serializing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import orjson
import xxhash

from proxy.canonical.messages import is_system_message

PartKind = Literal["system", "tool", "message"]


@dataclass(frozen=True, slots=True)
class RequestPart:
    """One part: ``name`` is ``system[i]``, ``tool[i]:<function name>`` or ``message[i]`` (body index)."""

    kind: PartKind
    index: int
    name: str
    role: str | None
    digest: bytes
    value: Any


def _digest(value: Any) -> bytes:
    try:
        raw = orjson.dumps(value)
    except (TypeError, orjson.JSONEncodeError):
        raw = repr(value).encode()
    return xxhash.xxh3_64_digest(raw)


def split_parts(body: Any) -> list[RequestPart]:
    """The parts of a chat request; odd shapes yield what can be recognised, never raise."""
    if not isinstance(body, dict):
        return []
    messages = body.get("messages")
    messages = messages if isinstance(messages, list) else []
    tools = body.get("tools")
    tools = tools if isinstance(tools, list) else []
    parts: list[RequestPart] = []
    k = 0
    while k < len(messages) and is_system_message(messages[k]):
        m = messages[k]
        parts.append(RequestPart("system", k, f"system[{k}]", m.get("role"), _digest(m), m))
        k += 1
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        label = f"tool[{i}]:{name}" if isinstance(name, str) else f"tool[{i}]"
        parts.append(RequestPart("tool", i, label, None, _digest(tool), tool))
    for i in range(k, len(messages)):
        m = messages[i]
        role = m.get("role") if isinstance(m, dict) else None
        parts.append(
            RequestPart("message", i, f"message[{i}]", role if isinstance(role, str) else None, _digest(m), m)
        )
    return parts


def first_differing_part(
    old: list[RequestPart], new: list[RequestPart]
) -> tuple[RequestPart | None, RequestPart | None] | None:
    """The first position where two part lists differ, as ``(old part, new part)`` (None past an end).

    None when ``new`` starts with all of ``old`` (the turn extended the previous one).
    """
    for a, b in zip(old, new, strict=False):
        if a.kind != b.kind or a.digest != b.digest:
            return a, b
    if len(old) > len(new):
        return old[len(new)], None
    return None


def first_differing_line(old: str, new: str) -> tuple[int, str, str] | None:
    """``(line number from 1, old line, new line)`` of the first differing line of two texts, or None."""
    if old == new:
        return None
    old_lines = old.split("\n")
    new_lines = new.split("\n")
    for i, (a, b) in enumerate(zip(old_lines, new_lines, strict=False)):
        if a != b:
            return i + 1, a, b
    n = min(len(old_lines), len(new_lines))
    return (
        n + 1,
        old_lines[n] if n < len(old_lines) else "",
        new_lines[n] if n < len(new_lines) else "",
    )
