"""A session's turn as the prefix-break explainer remembers it, and how two turns compare."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from proxy.canonical import RequestPart, split_parts

#: Approximate bytes of one cached ``RequestPart`` (the object, its name and digest; the value is
#: the body's own object, already counted).
PART_BYTES = 200


@dataclass(slots=True)
class Turn:
    """What the next turn of a session is compared with. The body, hashes and tokens are shared, never
    mutated; ``parts`` is filled in (and ``nbytes`` grown) the first time the turn is split."""

    number: int
    body: dict[str, Any]
    hashes: Sequence[bytes]
    tokens: array | None
    num_tokens: int
    block_size: int
    rank: str | None
    nbytes: int
    parts: list[RequestPart] | None = None
    #: Byte fingerprint of the body when compared without blocks (see ``Fingerprint``).
    fingerprint: Fingerprint | None = None


def parts(turn: Turn) -> list[RequestPart]:
    """The request parts of the session's newest ``turn``, split once and kept with it (its
    ``nbytes`` grows), so that the next turn's break is explained without splitting this body again."""
    found = turn.parts
    if found is None:
        found = turn.parts = split_parts(turn.body)
        turn.nbytes += len(found) * PART_BYTES
    return found


def parts_of(turn: Turn) -> list[RequestPart]:
    """The parts of a turn that is being replaced: its cached split, else a fresh one (not kept)."""
    return turn.parts if turn.parts is not None else split_parts(turn.body)


def divergence(prev: Turn, turn: Turn) -> tuple[int, int]:
    """(leading full blocks equal in both turns, first differing token offset)."""
    old, new = prev.hashes, turn.hashes
    # Chained hashes: equal at block k means equal at every block before k, so bisect.
    lo, hi = 0, min(len(old), len(new))
    while lo < hi:
        mid = (lo + hi) // 2
        if old[mid] == new[mid]:
            lo = mid + 1
        else:
            hi = mid
    common = lo
    a, b = prev.tokens, turn.tokens
    assert a is not None and b is not None
    start = common * prev.block_size
    end = (
        min(len(a), len(b), start + prev.block_size)
        if common < min(len(old), len(new))
        else min(len(a), len(b))
    )
    offset = start
    while offset < end and a[offset] == b[offset]:
        offset += 1
    return common, offset


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """A body as bytes, cheaply: its messages' JSON length and digest, and everything else's JSON."""

    messages_len: int
    messages_digest: int
    rest: bytes


def fingerprint(turn: Turn) -> bytes | None:
    """Fingerprint ``turn`` (kept on it for the next comparison); its messages' JSON, or None."""
    messages = turn.body.get("messages")
    if not isinstance(messages, list):
        return None
    try:
        dumped = orjson.dumps(messages)
        rest = orjson.dumps({k: v for k, v in turn.body.items() if k != "messages"})
    except TypeError:  # e.g. an integer beyond 64 bits
        return None
    turn.fingerprint = Fingerprint(len(dumped), xxhash.xxh3_64_intdigest(dumped), rest)
    return dumped


def extends(old: Turn, new: Turn) -> bool:
    """True when ``new``'s body re-sends ``old``'s byte for byte and only appends messages.

    Compared as JSON bytes (key order and number formats reach the tokens), with one serialization
    of the new body: the old turn's fingerprint was kept when it was the new one. Then no request
    part differs, and the common turn costs no splitting into parts.
    """
    if old.fingerprint is None:
        fingerprint(old)
    dumped = fingerprint(new)
    before, after = old.fingerprint, new.fingerprint
    if before is None or after is None or dumped is None or after.rest != before.rest:
        return False
    if len(dumped) == before.messages_len:
        return after.messages_digest == before.messages_digest
    cut = before.messages_len - 1  # the old list's bytes without its closing bracket
    if len(dumped) < before.messages_len or cut < 1 or dumped[cut] != ord(","):
        return False  # fewer bytes, or the old list does not end where a new message starts
    return xxhash.xxh3_64_intdigest(dumped[:cut] + b"]") == before.messages_digest
