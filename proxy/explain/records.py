"""The prefix-break records and their causes (the label values of ``prefixgate_prefix_breaks_total``)."""

from __future__ import annotations

import hashlib
import os
import time
from typing import TYPE_CHECKING, Any

from tokenization.base import common_prefix_len

if TYPE_CHECKING:
    from proxy.context import Expectation
    from proxy.explain.turns import Turn

SYSTEM_EDITED = "system_edited"
TOOLS_ADDED = "tools_added"
TOOLS_REMOVED = "tools_removed"
TOOLS_REORDERED = "tools_reordered"
TOOLS_CHANGED = "tools_changed"
HISTORY_EDITED = "history_edited"
HISTORY_DROPPED = "history_dropped"
REASONING_CHANGED = "reasoning_changed"
CACHE_SALT_CHANGED = "cache_salt_changed"
PROMPT_EDITED = "prompt_edited"  # /v1/completions: the prompt text has no parts
MOVED = "moved"
EVICTED = "evicted"
UNKNOWN = "unknown"  # the tokens differ but no request part does (a template-side change)

#: Characters of a line or name list kept in a break record, and names listed at most.
MAX_TEXT = 160
MAX_NAMES = 20
#: Keys a digest of an edited line: the same edit gives the same digest within this process, and a
#: stored digest cannot be checked against guessed prompt text.
_DIGEST_KEY = os.urandom(16)


def line_change(number: int, old: str, new: str) -> dict[str, Any]:
    """The first edited line of a part: where it is and what changed. The text (its first
    ``MAX_TEXT`` characters) is for this process's own view only: ``without_text`` drops it."""
    column = common_prefix_len(old, new)  # in C: a line may be a whole 80 kB prompt
    return {
        "number": number,
        "column": column,
        "old_chars": len(old),
        "new_chars": len(new),
        "old_digest": _digest(old),
        "new_digest": _digest(new),
        "old": old[:MAX_TEXT],
        "new": new[:MAX_TEXT],
    }


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, key=_DIGEST_KEY).hexdigest()


def without_text(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` as it may be stored (the session table, Redis) when bodies may not be logged: the
    edited line's positions and digests, not its text."""
    line = record.get("line")
    if line is None:
        return record
    return {**record, "line": {k: v for k, v in line.items() if k not in ("old", "new")}}


def record(
    turn: Turn,
    prev: Turn,
    cause: str,
    offset: int | None,
    block: int | None,
    lost: int | None,
    part: str | None,
    detail: str,
    **extra: Any,
) -> dict[str, Any]:
    """A break between the session's previous turn ``prev`` and this ``turn``."""
    out: dict[str, Any] = {
        "turn": turn.number,
        "time": time.time(),
        "cause": cause,
        "part": part,
        "token_offset": offset,
        "block_index": block,
        "lost_blocks": lost,
        "detail": detail,
        "backend": turn.rank,
        "previous_backend": prev.rank,
    }
    out.update(extra)
    return out


def moved(prev: Turn, turn: Turn, offset: int | None, block: int | None) -> dict[str, Any]:
    """The session went to another rank (seen without blocks, by the rank names alone)."""
    detail = f"session moved from {prev.rank} to {turn.rank}"
    return record(turn, prev, MOVED, offset, block, None, None, detail)


def rank_break(expected: Expectation, cached: int | None, cause: str) -> dict[str, Any]:
    """The rank hit fewer tokens than the prefix this turn shares with the previous one."""
    bs = expected.block_size
    expected_blocks = expected.expected_tokens // bs
    block = cached // bs if cached is not None else None
    if cause == MOVED:
        detail = f"session moved from {expected.previous_rank} to {expected.rank}"
    else:
        detail = f"{expected.rank} evicted the session's blocks from its pool"
    return {
        "turn": expected.turn,
        "time": time.time(),
        "cause": cause,
        "part": None,
        "token_offset": cached,
        "block_index": block,
        "lost_blocks": expected_blocks - block if block is not None else expected_blocks,
        "detail": detail,
        "backend": expected.rank,
        "previous_backend": expected.previous_rank,
        "expected_cached_tokens": expected.expected_tokens,
        "cached_tokens": cached,
    }
