"""Which segments of a chat turn equal the previous turn's, without serializing what did not change.

A turn's segments are its system turn (system message + tools), its messages and its generation
prompt; a segment's token ids depend on its inputs alone (ChatML's special tokens split
tokenization). ``SegmentMemo`` keeps the previous turn's inputs: its own message objects (the
prompt's, never copied) and digests where a digest is needed. ``diff`` compares:

- a *plain* message (``plain``: rendered from strings alone) by ``==``, which is then an exact
  change test; a run of plain messages in one C-level list comparison, so a returning session's
  unchanged conversation costs one ``memcmp``-speed pass, not one Python step per message;
- the system turn and other messages (JSON-rendered parts or tool arguments, where key order or
  ``1`` against ``1.0`` reach the text) by the xxh3-128 of their JSON bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash


def canonical_json(value: Any) -> bytes:
    """Deterministic bytes of a message or tool list (orjson keeps key order); a cache key only."""
    try:
        return orjson.dumps(value)
    except TypeError:  # e.g. integers beyond 64 bits, which orjson refuses
        return json.dumps(value, ensure_ascii=False, default=repr).encode()


def digest(value: Any) -> int:
    return xxhash.xxh3_128_intdigest(canonical_json(value))


def plain(message: Mapping[str, Any]) -> bool:
    """Whether ``message`` renders from strings alone (role, text content or text parts, tool calls
    with string arguments). For such a message ``==`` is an exact change test: a string only
    equals a string, and key order or ``1`` against ``1.0`` never reach its text. Other messages
    (JSON-rendered parts or arguments) are compared by their JSON bytes."""
    role = message.get("role", "user")
    if not isinstance(role, str):
        return False
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        if not isinstance(content, list):
            return False
        for part in content:
            if not isinstance(part, str) and not (
                isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                return False
    calls = message.get("tool_calls") if role == "assistant" else None
    if isinstance(calls, list):
        for call in calls:
            fn = call.get("function", call) if isinstance(call, Mapping) else None
            if not (
                isinstance(fn, Mapping)
                and isinstance(fn.get("name", ""), str)
                and isinstance(fn.get("arguments", ""), str)
            ):
                return False
    return True


@dataclass(frozen=True, slots=True)
class SegmentMemo:
    """One chat turn's segments as the next turn compares with them."""

    #: Digest of the system turn's inputs; None: the turn had no system segment.
    system_key: int | None
    #: The message objects of the message segments, in order.
    messages: tuple[Any, ...]
    #: Per message: the digest of its JSON, or None for a plain message.
    keys: tuple[int | None, ...]
    #: Leading messages that are all plain.
    plain_head: int
    #: Token offset where each segment ends (system turn first, generation prompt last).
    ends: tuple[int, ...]
    generation: bool

    @property
    def offset(self) -> int:
        """Index of the first message's segment."""
        return 0 if self.system_key is None else 1

    def span(self, segment: int) -> tuple[int, int]:
        """Token range of ``segment``."""
        return (self.ends[segment - 1] if segment else 0), self.ends[segment]


@dataclass(slots=True)
class Diff:
    """How a turn's segments compare with the previous turn's."""

    system_key: int | None
    keys: list[int | None]  # per message, as ``SegmentMemo.keys``
    same: list[bool]  # per message: equal to the previous turn's message at the same index
    plain_head: int
    #: Leading segments equal to the previous turn's (their ids and block hashes are reused).
    first: int
    generation_same: bool


def diff(
    system: tuple[Any, Any] | None,
    messages: Sequence[Mapping[str, Any]],
    generation: bool,
    memo: SegmentMemo | None,
) -> Diff:
    """Compare a turn (its system turn's inputs or None, its message segments, whether it ends with
    a generation prompt) with the previous turn's ``memo``."""
    system_key = digest([system[0], system[1]]) if system is not None else None
    n = len(messages)
    keys: list[int | None] = [None] * n
    same = [False] * n
    start = 0
    old: tuple[Any, ...] = memo.messages if memo is not None else ()
    if memo is not None:
        head = min(n, len(old), memo.plain_head)
        if head and tuple(messages[:head]) == old[:head]:
            same[:head] = [True] * head  # plain, equal: no key needed
            start = head
    plain_head = start
    for i in range(start, n):
        message = messages[i]
        if i < len(old) and memo is not None and memo.keys[i] is None:
            if message == old[i]:
                same[i] = True  # and plain, like the message it equals
            elif not plain(message):
                keys[i] = digest(message)
        elif plain(message):
            same[i] = False
        else:
            keys[i] = key = digest(message)
            same[i] = i < len(old) and memo is not None and memo.keys[i] == key
        if plain_head == i and keys[i] is None:
            plain_head += 1
    first = 0
    generation_same = memo is not None and memo.generation and generation and len(old) == n
    if memo is not None and memo.system_key == system_key:
        try:
            run = same.index(False)
        except ValueError:
            run = n
        first = (1 if system is not None else 0) + run
        if run == n and generation_same:
            first += 1
    return Diff(system_key, keys, same, plain_head, first, generation_same)
