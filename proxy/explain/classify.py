"""Which request part broke a session's prefix, and how: the explainer's explanations.

Only called for a real break (the chained hashes diverge before the previous turn's last full
block); then the two bodies are split into request parts (``proxy.canonical.split_parts``) to say
which part changed: system prompt (with the first differing line), tools added/removed/reordered/
changed, history message N edited or dropped, reasoning settings or ``cache_salt`` changed.
"""

from __future__ import annotations

from typing import Any

from proxy.canonical import RequestPart, first_differing_line, first_differing_part, split_parts
from proxy.explain.records import (
    CACHE_SALT_CHANGED,
    HISTORY_DROPPED,
    HISTORY_EDITED,
    MAX_NAMES,
    MAX_TEXT,
    PROMPT_EDITED,
    REASONING_CHANGED,
    SYSTEM_EDITED,
    TOOLS_ADDED,
    TOOLS_CHANGED,
    TOOLS_REMOVED,
    TOOLS_REORDERED,
    UNKNOWN,
    line_change,
    record,
)
from proxy.explain.turns import Turn, parts, parts_of
from tokenization.chatml import content_text
from tokenization.prompt import PromptBlocks

#: Body fields that steer the chat template or the reasoning without being a request part.
REASONING_FIELDS = ("reasoning_effort", "reasoning", "chat_template_kwargs", "thinking", "include_reasoning")


def explain(
    prev: Turn, turn: Turn, blocks: PromptBlocks | None, offset: int, common_blocks: int
) -> dict[str, Any]:
    """The break at token ``offset`` (block ``common_blocks``) between ``prev`` and ``turn``: which
    request part changed, and how."""
    lost = len(prev.hashes) - common_blocks
    if prev.body.get("cache_salt") != turn.body.get("cache_salt"):
        return record(turn, prev, CACHE_SALT_CHANGED, offset, common_blocks, lost, None, "cache_salt changed")
    old_parts = parts_of(prev)
    new_parts = parts(turn)
    found = first_differing_part(old_parts, new_parts)
    settings_changed = _settings(prev.body) != _settings(turn.body)
    if settings_changed:
        # A part that differs only after the first differing token is not what broke the prefix.
        label = blocks.part_at(offset) if blocks is not None else None
        if found is None or not _part_matches_label(found, label):
            return record(
                turn,
                prev,
                REASONING_CHANGED,
                offset,
                common_blocks,
                lost,
                label,
                "reasoning settings changed",
                settings={"old": _settings(prev.body), "new": _settings(turn.body)},
            )
    if found is None:
        if not old_parts and not new_parts:
            return record(turn, prev, PROMPT_EDITED, offset, common_blocks, lost, None, "prompt edited")
        return record(
            turn, prev, UNKNOWN, offset, common_blocks, lost, None, "tokens differ, request parts do not"
        )
    return classify(prev, turn, found, offset, common_blocks, lost)


def classify(
    prev: Turn,
    turn: Turn,
    found: tuple[RequestPart | None, RequestPart | None],
    offset: int | None,
    block: int | None,
    lost: int | None,
) -> dict[str, Any]:
    old, new = found
    kinds = {p.kind for p in (old, new) if p is not None}
    part = new if new is not None else old
    assert part is not None  # first_differing_part never returns (None, None)
    name = part.name
    if "system" in kinds:
        old_text = _system_text(old)
        new_text = _system_text(new)
        line = first_differing_line(old_text, new_text)
        extra: dict[str, Any] = {}
        detail = "system prompt edited"
        if line is not None:
            number, a, b = line
            extra["line"] = line_change(number, a, b)
            detail = f"system prompt edited at line {number}"
        if old is not None and new is not None and old.kind != new.kind:
            detail = "system message added" if new.kind == "system" else "system message removed"
        return record(turn, prev, SYSTEM_EDITED, offset, block, lost, name, detail, **extra)
    if "tool" in kinds:
        return _tools(prev, turn, offset, block, lost, name)
    return _history(prev, turn, old, new, offset, block, lost, name)


def _tools(
    prev: Turn, turn: Turn, offset: int | None, block: int | None, lost: int | None, name: str
) -> dict[str, Any]:
    old = _tool_digests(prev.body)
    new = _tool_digests(turn.body)
    old_names = [n for n, _ in old]
    new_names = [n for n, _ in new]
    old_set, new_set = set(old_names), set(new_names)
    added = [n for n in new_names if n not in old_set]
    removed = [n for n in old_names if n not in new_set]
    old_by_name = dict(old)
    changed = [n for n, d in new if n in old_by_name and old_by_name[n] != d]
    tools = {
        "added": added[:MAX_NAMES],
        "removed": removed[:MAX_NAMES],
        "changed": changed[:MAX_NAMES],
    }
    if added and not removed and not changed:
        cause, detail = TOOLS_ADDED, f"tools added: {', '.join(added)}"
    elif removed and not added and not changed:
        cause, detail = TOOLS_REMOVED, f"tools removed: {', '.join(removed)}"
    elif not added and not removed and not changed:
        cause, detail = TOOLS_REORDERED, "tools reordered"
    else:
        cause = TOOLS_CHANGED
        what = [f"{k}: {', '.join(v)}" for k, v in tools.items() if v]
        detail = "tools changed (" + "; ".join(what) + ")" if what else "tools changed"
    return record(turn, prev, cause, offset, block, lost, name, detail[: MAX_TEXT * 2], tools=tools)


def _history(
    prev: Turn,
    turn: Turn,
    old: RequestPart | None,
    new: RequestPart | None,
    offset: int | None,
    block: int | None,
    lost: int | None,
    name: str,
) -> dict[str, Any]:
    part = old if old is not None else new
    assert part is not None  # first_differing_part never returns (None, None)
    index, role = part.index, part.role
    old_messages = prev.body.get("messages")
    new_messages = turn.body.get("messages")
    n_old = len(old_messages) if isinstance(old_messages, list) else 0
    n_new = len(new_messages) if isinstance(new_messages, list) else 0
    message = {"index": index, "role": role}
    if new is None or n_new < n_old or _is_deletion(old_messages, new_messages, index):
        detail = f"history from message {index} dropped ({n_old} -> {n_new} messages)"
        return record(turn, prev, HISTORY_DROPPED, offset, block, lost, name, detail, message=message)
    extra: dict[str, Any] = {"message": message}
    if old is not None and isinstance(old.value, dict) and isinstance(new.value, dict):
        line = first_differing_line(
            content_text(old.value.get("content")), content_text(new.value.get("content"))
        )
        if line is not None:
            number, a, b = line
            extra["line"] = line_change(number, a, b)
    detail = f"history message {index} ({role}) edited"
    return record(turn, prev, HISTORY_EDITED, offset, block, lost, name, detail, **extra)


def _settings(body: dict[str, Any]) -> dict[str, Any]:
    return {k: body[k] for k in REASONING_FIELDS if k in body}


def _system_text(part: RequestPart | None) -> str:
    if part is None or part.kind != "system" or not isinstance(part.value, dict):
        return ""
    return content_text(part.value.get("content"))


def _tool_digests(body: dict[str, Any]) -> list[tuple[str, bytes]]:
    return [(_tool_name(p), p.digest) for p in split_parts({"tools": body.get("tools")}) if p.kind == "tool"]


def _tool_name(part: RequestPart) -> str:
    _, _, name = part.name.partition(":")
    return name or part.name


def _is_deletion(old: Any, new: Any, index: int) -> bool:
    """Whether message ``index`` of ``old`` was removed in ``new`` (the next one took its place)."""
    if not isinstance(old, list) or not isinstance(new, list):
        return False
    return index + 1 < len(old) and index < len(new) and old[index + 1] == new[index]


def _part_matches_label(found: tuple[RequestPart | None, RequestPart | None], label: str | None) -> bool:
    """Whether the differing request part is the tokenizer's part ``label`` (where the tokens differ)."""
    if label is None:
        return True  # no token map: trust the parts
    part = found[1] or found[0]
    assert part is not None
    # Labels differ by tokenizer: tiktoken names the system turn "system"/"tools"/"system+tools",
    # hf names spans per message ("prelude", "message[i]"), the tools joining the system message.
    if part.kind == "message" or (part.kind == "system" and part.index > 0):
        return label == f"message[{part.index}]"
    if part.kind == "system":
        return label in _SYSTEM_LABELS or label == f"message[{part.index}]"
    return label in _SYSTEM_LABELS or label == "message[0]"


_SYSTEM_LABELS = frozenset({"system", "tools", "system+tools", "prelude"})
