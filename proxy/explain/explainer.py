"""The prefix-break explainer: where and why a session's prompt stopped extending its previous turn.

It keeps, on each thread of a session's local state (``proxy.state.local``), the previous turn
(``Turn``): its block hashes and tokens (shared with the blocks stage, not copied), its prompt body and
the rank it went to. The pipeline tells it of each request twice:

- ``routed``: the first block whose chained hash differs from the previous turn's is found by
  binary search (a chained hash equal at block k means blocks 0..k are equal). A divergence before
  the previous turn's last full block is a *break*, explained by ``explain`` (which part changed).
  The request carries away what it should hit (``ctx.expectation``).
- ``finished``: when the rank reported fewer cached tokens than the prefix this turn shares with
  the previous one, the session either moved to another rank or its blocks were evicted.

Only a real break is explained: then the two bodies are split into request parts
(``proxy.canonical.split_parts``, once per turn, kept with it) to say which part changed: system
prompt (with the first differing line), tools added/removed/reordered/changed, history message N
edited or dropped, reasoning settings or ``cache_salt`` changed. Without blocks, two turns are
compared by their bodies' bytes (``extends``), then by parts.

Canonicalization runs before, so what is reported is the drift that remains. Breaks are counted in
``prefixgate_prefix_breaks_total{cause}`` (the causes below are its label values) and kept per
session for ``GET /admin/sessions/{id}``: this process's recent ones with the edited line's text,
the stored ones (the session table, which Redis keeps a day) with its positions and digests only,
unless bodies may be logged.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from proxy.canonical import RequestPart, first_differing_line, first_differing_part, split_parts
from proxy.context import Expectation, Outcome, RequestContext
from proxy.ops.metrics import Metrics
from proxy.state.local import MAIN, SessionLocal, SessionLocals, ThreadLocal
from tokenization.base import common_prefix_len
from tokenization.prompt import PromptBlocks
from tokenization.tiktoken_tokenizer import content_text

#: The causes of a break (the label values of ``prefixgate_prefix_breaks_total``).
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


class Explainer:
    """Detects and explains prefix breaks per session.

    ``on_break(session_key, record)`` is called for every break (e.g. the session table's
    ``add_break``).
    """

    def __init__(
        self,
        locals_: SessionLocals,
        metrics: Metrics | None = None,
        *,
        on_break: Callable[[str, dict[str, Any]], object] | None = None,
        keep_text: bool = False,
    ) -> None:
        """``keep_text``: records given to ``on_break`` (stored, possibly shared through Redis) keep
        the edited prompt text; only when request bodies may be logged (``--log-bodies``)."""
        self.locals = locals_
        self.metrics = metrics
        self.on_break = on_break
        self.keep_text = keep_text

    def breaks(self, session_key: str) -> list[dict[str, Any]]:
        """The session's recorded breaks, oldest first; [] when this process holds none."""
        local = self.locals.get(session_key)
        return list(local.breaks) if local is not None else []

    def routed(self, ctx: RequestContext) -> None:
        """Compare the routed turn with the session's previous turn; then it becomes the previous turn."""
        local, thread = ctx.local, ctx.conversation
        if local is None or thread is None or ctx.prompt is None:
            return
        prev: Turn | None = thread.turn
        turn = turn_of(ctx, ctx.prompt, prev.number + 1 if prev is not None else 0)
        self._replace(local, thread, turn)
        if prev is None:
            return
        release_later(prev)
        blocks = ctx.prompt_blocks
        if blocks is not None and prev.tokens is not None and prev.block_size == blocks.block_size:
            common_blocks, offset = divergence(prev, turn)
            if common_blocks < len(prev.hashes):
                self._record(ctx, local, thread, explain(prev, turn, blocks, offset, common_blocks))
            hittable = max(turn.num_tokens - 1, 0) // turn.block_size
            expected = min(common_blocks, hittable) * turn.block_size
            ctx.expectation = Expectation(
                turn.number, expected, turn.num_tokens, turn.block_size, turn.rank, prev.rank
            )
        elif blocks is None and prev.tokens is None:
            # No blocks (policy without them, or an unrenderable body): compare by parts alone,
            # after a C-level deep comparison has shown the new body does not simply extend the old.
            found = None if extends(prev, turn) else first_differing_part(parts_of(prev), parts(turn))
            if found is not None:
                self._record(ctx, local, thread, classify(prev, turn, found, None, None, None))
            elif prev.rank is not None and turn.rank != prev.rank:
                self._record(ctx, local, thread, moved(prev, turn, None, None))
        self._charge(local, thread, turn)

    def finished(self, outcome: Outcome) -> None:
        """The rank answered (with ``cached_tokens``, or without saying): a rank-side break?

        When the rank counted the prompt differently from prefixgate, the tokenizer is not the
        rank's and block offsets cannot be compared, so nothing is judged.
        """
        ctx = outcome.ctx
        expected = ctx.expectation
        local, thread = ctx.local, ctx.conversation
        if expected is None or local is None or thread is None or not outcome.answered:
            return
        if self.locals.get(local.key) is not local:
            return  # the session's state was evicted (or ended) meanwhile
        usage = outcome.usage
        if usage is not None and usage.prompt_tokens != expected.num_tokens:
            return
        was_moved = expected.previous_rank is not None and expected.rank != expected.previous_rank
        cached = usage.cached_tokens if usage is not None else None
        if cached is None:
            if was_moved:
                self._record(ctx, local, thread, rank_break(expected, None, MOVED))
            return
        if cached < expected.expected_tokens:
            self._record(ctx, local, thread, rank_break(expected, cached, MOVED if was_moved else EVICTED))

    def _replace(self, local: SessionLocal, thread: ThreadLocal, turn: Turn) -> None:
        thread.turn = turn
        self._charge(local, thread, turn)

    def _charge(self, local: SessionLocal, thread: ThreadLocal, turn: Turn) -> None:
        thread.turn_bytes = turn.nbytes
        self.locals.charge(local)

    def _record(
        self, ctx: RequestContext, local: SessionLocal, thread: ThreadLocal, record: dict[str, Any]
    ) -> None:
        """A break of ``thread``: records of threads other than the main one name theirs, and every
        record's ``turn`` is the session's (as the dashboard's turn log numbers them), the thread's
        own in ``thread_turn`` where they differ."""
        if thread.key != MAIN:
            record["thread"] = thread.key
        session = ctx.admitted.session if ctx.admitted is not None else None
        if session is not None and session.turns - 1 != record.get("turn"):
            record["thread_turn"], record["turn"] = record.get("turn"), session.turns - 1
        thread.breaks += 1
        local.breaks.append(record)
        if self.metrics is not None:
            self.metrics.prefix_breaks.labels(record["cause"]).inc()
        if self.on_break is not None:
            self.on_break(local.key, record if self.keep_text else without_text(record))


def release_later(turn: Turn) -> None:
    """Let the replaced ``turn`` go at the loop's next turn, after this request's answer is sent.

    It holds the previous turn's parsed body and block hashes, thousands of objects for a long
    conversation (freeing a 100k-token turn's takes ~0.2 ms), and this is their last reference:
    dropped here, that was paid on the way to the rank's answer.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # called outside a loop: nothing waits on this caller
        return
    loop.call_soon(_drop, turn)


def _drop(_: object) -> None:
    """Nothing: the loop's handle held the reference, and lets it go once this has run."""


def turn_of(ctx: RequestContext, body: dict[str, Any], number: int) -> Turn:
    """The routed request as the session's next previous turn (its ``prompt`` body and blocks)."""
    blocks = ctx.prompt_blocks
    rank = ctx.rank.name if ctx.rank is not None else None
    # A parsed JSON body takes a few times its wire size in Python objects.
    nbytes = 3 * len(ctx.raw_body) + 256
    if blocks is None:
        return Turn(number, body, (), None, 0, 0, rank, nbytes)
    nbytes += len(blocks.tokens) * 4 + len(blocks.block_hashes) * 72
    return Turn(
        number,
        body,
        blocks.block_hashes,
        blocks.tokens,
        blocks.num_tokens,
        blocks.block_size,
        rank,
        nbytes,
    )


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
