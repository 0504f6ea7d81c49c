"""The prefix-break explainer: where and why a session's prompt stopped extending its previous turn.

Per session (bounded LRU, with a byte budget) it keeps the previous turn: its block hashes and tokens
(shared with the blocks stage, not copied), its canonical body and the rank it went to. On each turn:

- after routing (``after_route``): the first block whose chained hash differs from the previous
  turn's is found by binary search (a chained hash equal at block k means blocks 0..k are equal).
  A divergence before the previous turn's last full block is a *break*; only then are the two
  bodies split into request parts (``proxy.canonical.split_parts``) to say which part changed:
  system prompt (with the first differing line), tools added/removed/reordered/changed, history
  message N edited or dropped, reasoning settings or ``cache_salt`` changed.
- after the rank's answer (``after_observe``): when the rank reported fewer cached tokens than the
  prefix this turn shares with the previous one, the session either moved to another rank or its
  blocks were evicted from the rank's pool.

Canonicalization runs before, so what is reported is the drift that remains. Breaks are counted in
``prefixgate_prefix_breaks_total{cause}`` and kept per session for ``GET /admin/sessions/{id}``.
"""

from __future__ import annotations

import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash

from proxy.canonical import RequestPart, first_differing_line, first_differing_part, split_parts
from proxy.context import RequestContext
from proxy.metrics import Metrics
from tokenization.chatml import content_text

# Causes, the label values of prefixgate_prefix_breaks_total.
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

CAUSES = (
    SYSTEM_EDITED,
    TOOLS_ADDED,
    TOOLS_REMOVED,
    TOOLS_REORDERED,
    TOOLS_CHANGED,
    HISTORY_EDITED,
    HISTORY_DROPPED,
    REASONING_CHANGED,
    CACHE_SALT_CHANGED,
    PROMPT_EDITED,
    MOVED,
    EVICTED,
    UNKNOWN,
)

#: Body fields that steer the chat template or the reasoning without being a request part.
REASONING_FIELDS = ("reasoning_effort", "reasoning", "chat_template_kwargs", "thinking", "include_reasoning")

_MAX_TEXT = 160  # characters of a line or name list kept in a break record
_MAX_NAMES = 20


#: Approximate bytes of one cached ``RequestPart`` (the object, its name and digest; the value is
#: the body's own object, already counted).
_PART_BYTES = 200


@dataclass(slots=True)
class _Turn:
    """What the next turn of a session is compared with. The body, hashes and tokens are shared, never
    mutated; ``parts`` is filled in (and ``nbytes`` grown) the first time the turn is split."""

    number: int
    body: dict[str, Any]
    hashes: Sequence[bytes]
    tokens: array | None
    num_tokens: int
    block_size: int
    backend: str | None
    nbytes: int
    parts: list[RequestPart] | None = None
    #: Byte fingerprint of the body when compared without blocks (see ``_Fingerprint``).
    fingerprint: _Fingerprint | None = None


@dataclass(slots=True)
class _Pending:
    """A routed turn awaiting the rank's answer: what it should hit if the rank kept the prefix."""

    session: str
    turn: int
    expected_tokens: int  # tokens of the prefix shared with the previous turn, whole hittable blocks
    num_tokens: int  # the prompt's tokens as prefixgate counted them
    block_size: int
    backend: str | None
    previous_backend: str | None


@dataclass(slots=True)
class _Session:
    turn: _Turn | None = None
    breaks: deque[dict[str, Any]] = field(default_factory=deque)


class Explainer:
    """Detects and explains prefix breaks per session.

    ``capacity``: sessions remembered (least recently used dropped first); ``budget_bytes``: an
    approximate bound on the bodies and tokens kept for them; ``max_breaks``: breaks kept per session.
    ``on_break(session_key, record)`` is called for every break (e.g. the session table's ``add_break``).
    """

    def __init__(
        self,
        metrics: Metrics | None = None,
        *,
        capacity: int = 10_000,
        budget_bytes: int = 256 * 1024 * 1024,
        max_breaks: int = 32,
        max_pending: int = 4096,
        on_break: Callable[[str, dict[str, Any]], object] | None = None,
    ) -> None:
        self.metrics = metrics
        self.capacity = capacity
        self.budget_bytes = budget_bytes
        self.max_breaks = max_breaks
        self.max_pending = max_pending
        self.on_break = on_break
        self.nbytes = 0
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._pending: OrderedDict[int, _Pending] = OrderedDict()

    # -- public API --------------------------------------------------------------------------------

    def breaks(self, session_key: str) -> list[dict[str, Any]]:
        """The session's recorded breaks, oldest first (at most ``max_breaks``); [] when unknown."""
        session = self._sessions.get(session_key)
        return list(session.breaks) if session is not None else []

    def after_route(self, ctx: RequestContext) -> None:
        """Compare the routed turn with the session's previous turn; then it becomes the previous turn."""
        key = ctx.session_key
        if key is None:
            return
        session = self._session(key)
        prev = session.turn
        turn = self._turn_of(ctx, prev.number + 1 if prev is not None else 0)
        self._replace(session, turn)
        if prev is None:
            return
        blocks = ctx.prompt_blocks
        if blocks is not None and prev.tokens is not None and prev.block_size == blocks.block_size:
            common_blocks, offset = _divergence(prev, turn)
            if common_blocks < len(prev.hashes):
                self._record(key, session, self._explain(prev, turn, ctx, offset, common_blocks))
            hittable = max(turn.num_tokens - 1, 0) // turn.block_size
            expected = min(common_blocks, hittable) * turn.block_size
            self._expect(ctx, key, turn, expected, prev.backend)
        elif blocks is None and prev.tokens is None:
            # No blocks (policy without them, or an unrenderable body): compare by parts alone,
            # after a C-level deep comparison has shown the new body does not simply extend the old.
            found = None if _extends(prev, turn) else first_differing_part(_parts_of(prev), self._parts(turn))
            if found is not None:
                self._record(key, session, self._classify(prev, turn, found, None, None, None))
            elif prev.backend is not None and turn.backend != prev.backend:
                self._record(key, session, self._moved(prev, turn, None, None))

    def after_observe(
        self, ctx: RequestContext, cached_tokens: int | None, prompt_tokens: int | None = None
    ) -> None:
        """The rank answered with ``cached_tokens`` (None: it did not say): a rank-side break?

        ``prompt_tokens`` as the rank counted them: when it differs from prefixgate's count, the
        tokenizer is not the rank's and block offsets cannot be compared, so nothing is judged.
        """
        pending = self._pending.pop(id(ctx), None)
        if pending is None:
            return
        if prompt_tokens is not None and prompt_tokens != pending.num_tokens:
            return
        session = self._sessions.get(pending.session)
        if session is None:
            return
        moved = pending.previous_backend is not None and pending.backend != pending.previous_backend
        if cached_tokens is None:
            if moved:
                self._record(pending.session, session, self._rank_break(pending, None, MOVED))
            return
        if cached_tokens < pending.expected_tokens:
            cause = MOVED if moved else EVICTED
            self._record(pending.session, session, self._rank_break(pending, cached_tokens, cause))

    # -- bookkeeping -------------------------------------------------------------------------------

    def _session(self, key: str) -> _Session:
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = _Session(breaks=deque(maxlen=self.max_breaks))
            while len(self._sessions) > self.capacity:
                self._drop_oldest()
        else:
            self._sessions.move_to_end(key)
        return session

    def _drop_oldest(self) -> None:
        _, old = self._sessions.popitem(last=False)
        if old.turn is not None:
            self.nbytes -= old.turn.nbytes

    def _replace(self, session: _Session, turn: _Turn) -> None:
        if session.turn is not None:
            self.nbytes -= session.turn.nbytes
        session.turn = turn
        self.nbytes += turn.nbytes
        while self.nbytes > self.budget_bytes and len(self._sessions) > 1:
            self._drop_oldest()

    @staticmethod
    def _turn_of(ctx: RequestContext, number: int) -> _Turn:
        blocks = ctx.prompt_blocks
        backend = ctx.backend.name if ctx.backend is not None else None
        # A parsed JSON body takes a few times its wire size in Python objects.
        nbytes = 3 * len(ctx.raw_body) + 256
        if blocks is None:
            return _Turn(number, ctx.body, (), None, 0, 0, backend, nbytes)
        nbytes += len(blocks.tokens) * 4 + len(blocks.block_hashes) * 72
        return _Turn(
            number,
            ctx.body,
            blocks.block_hashes,
            blocks.tokens,
            blocks.num_tokens,
            blocks.block_size,
            backend,
            nbytes,
        )

    def _parts(self, turn: _Turn) -> list[RequestPart]:
        """The request parts of the session's newest ``turn``, split once and kept with it, so that
        the next turn's break is explained without splitting this body again."""
        parts = turn.parts
        if parts is None:
            parts = turn.parts = split_parts(turn.body)
            added = len(parts) * _PART_BYTES
            turn.nbytes += added
            self.nbytes += added
        return parts

    def _expect(
        self, ctx: RequestContext, key: str, turn: _Turn, expected: int, prev_backend: str | None
    ) -> None:
        pending = self._pending
        pending[id(ctx)] = _Pending(
            key, turn.number, expected, turn.num_tokens, turn.block_size, turn.backend, prev_backend
        )
        while len(pending) > self.max_pending:  # requests that failed are never observed
            pending.popitem(last=False)

    def _record(self, key: str, session: _Session, record: dict[str, Any]) -> None:
        session.breaks.append(record)
        if self.metrics is not None:
            self.metrics.prefix_breaks.labels(record["cause"]).inc()
        if self.on_break is not None:
            self.on_break(key, record)

    # -- explanations ------------------------------------------------------------------------------

    def _explain(
        self, prev: _Turn, turn: _Turn, ctx: RequestContext, offset: int, common_blocks: int
    ) -> dict[str, Any]:
        lost = len(prev.hashes) - common_blocks
        if prev.body.get("cache_salt") != turn.body.get("cache_salt"):
            return _record(
                turn, prev, CACHE_SALT_CHANGED, offset, common_blocks, lost, None, "cache_salt changed"
            )
        old_parts = _parts_of(prev)
        new_parts = self._parts(turn)
        found = first_differing_part(old_parts, new_parts)
        settings_changed = _settings(prev.body) != _settings(turn.body)
        if settings_changed:
            # A part that differs only after the first differing token is not what broke the prefix.
            blocks = ctx.prompt_blocks
            label = blocks.part_at(offset) if blocks is not None else None
            if found is None or not _part_matches_label(found, label):
                return _record(
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
                return _record(turn, prev, PROMPT_EDITED, offset, common_blocks, lost, None, "prompt edited")
            return _record(
                turn, prev, UNKNOWN, offset, common_blocks, lost, None, "tokens differ, request parts do not"
            )
        return self._classify(prev, turn, found, offset, common_blocks, lost)

    def _classify(
        self,
        prev: _Turn,
        turn: _Turn,
        found: tuple[RequestPart | None, RequestPart | None],
        offset: int | None,
        block: int | None,
        lost: int | None,
    ) -> dict[str, Any]:
        old, new = found
        kinds = {p.kind for p in (old, new) if p is not None}
        name = (new or old).name  # type: ignore[union-attr]
        if "system" in kinds:
            old_text = _system_text(old)
            new_text = _system_text(new)
            line = first_differing_line(old_text, new_text)
            extra: dict[str, Any] = {}
            detail = "system prompt edited"
            if line is not None:
                number, a, b = line
                extra["line"] = {"number": number, "old": a[:_MAX_TEXT], "new": b[:_MAX_TEXT]}
                detail = f"system prompt edited at line {number}"
            if old is not None and new is not None and old.kind != new.kind:
                detail = "system message added" if new.kind == "system" else "system message removed"
            return _record(turn, prev, SYSTEM_EDITED, offset, block, lost, name, detail, **extra)
        if "tool" in kinds:
            return self._tools(prev, turn, offset, block, lost, name)
        return self._history(prev, turn, old, new, offset, block, lost, name)

    @staticmethod
    def _tools(
        prev: _Turn, turn: _Turn, offset: int | None, block: int | None, lost: int | None, name: str
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
            "added": added[:_MAX_NAMES],
            "removed": removed[:_MAX_NAMES],
            "changed": changed[:_MAX_NAMES],
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
        return _record(turn, prev, cause, offset, block, lost, name, detail[: _MAX_TEXT * 2], tools=tools)

    @staticmethod
    def _history(
        prev: _Turn,
        turn: _Turn,
        old: RequestPart | None,
        new: RequestPart | None,
        offset: int | None,
        block: int | None,
        lost: int | None,
        name: str,
    ) -> dict[str, Any]:
        index = (old or new).index  # type: ignore[union-attr]
        role = (old or new).role  # type: ignore[union-attr]
        old_messages = prev.body.get("messages")
        new_messages = turn.body.get("messages")
        n_old = len(old_messages) if isinstance(old_messages, list) else 0
        n_new = len(new_messages) if isinstance(new_messages, list) else 0
        message = {"index": index, "role": role}
        if new is None or n_new < n_old or _is_deletion(old_messages, new_messages, index):
            detail = f"history from message {index} dropped ({n_old} -> {n_new} messages)"
            return _record(turn, prev, HISTORY_DROPPED, offset, block, lost, name, detail, message=message)
        extra: dict[str, Any] = {"message": message}
        if old is not None and isinstance(old.value, dict) and isinstance(new.value, dict):
            line = first_differing_line(
                content_text(old.value.get("content")), content_text(new.value.get("content"))
            )
            if line is not None:
                number, a, b = line
                extra["line"] = {"number": number, "old": a[:_MAX_TEXT], "new": b[:_MAX_TEXT]}
        detail = f"history message {index} ({role}) edited"
        return _record(turn, prev, HISTORY_EDITED, offset, block, lost, name, detail, **extra)

    @staticmethod
    def _moved(prev: _Turn, turn: _Turn, offset: int | None, block: int | None) -> dict[str, Any]:
        detail = f"session moved from {prev.backend} to {turn.backend}"
        return _record(turn, prev, MOVED, offset, block, None, None, detail)

    @staticmethod
    def _rank_break(pending: _Pending, cached: int | None, cause: str) -> dict[str, Any]:
        bs = pending.block_size
        expected_blocks = pending.expected_tokens // bs
        block = cached // bs if cached is not None else None
        if cause == MOVED:
            detail = f"session moved from {pending.previous_backend} to {pending.backend}"
        else:
            detail = f"{pending.backend} evicted the session's blocks from its pool"
        return {
            "turn": pending.turn,
            "time": time.time(),
            "cause": cause,
            "part": None,
            "token_offset": cached,
            "block_index": block,
            "lost_blocks": expected_blocks - block if block is not None else expected_blocks,
            "detail": detail,
            "backend": pending.backend,
            "previous_backend": pending.previous_backend,
            "expected_cached_tokens": pending.expected_tokens,
            "cached_tokens": cached,
        }


# -- helpers ---------------------------------------------------------------------------------------


def _parts_of(prev: _Turn) -> list[RequestPart]:
    """The parts of a turn that is being replaced: its cached split, else a fresh one (not kept)."""
    return prev.parts if prev.parts is not None else split_parts(prev.body)


def _divergence(prev: _Turn, turn: _Turn) -> tuple[int, int]:
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


def _record(
    turn: _Turn,
    prev: _Turn,
    cause: str,
    offset: int | None,
    block: int | None,
    lost: int | None,
    part: str | None,
    detail: str,
    **extra: Any,
) -> dict[str, Any]:
    record: dict[str, Any] = {
        "turn": turn.number,
        "time": time.time(),
        "cause": cause,
        "part": part,
        "token_offset": offset,
        "block_index": block,
        "lost_blocks": lost,
        "detail": detail,
        "backend": turn.backend,
        "previous_backend": prev.backend,
    }
    record.update(extra)
    return record


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


@dataclass(frozen=True, slots=True)
class _Fingerprint:
    """A body as bytes, cheaply: its messages' JSON length and digest, and everything else's JSON."""

    messages_len: int
    messages_digest: int
    rest: bytes


def _fingerprint(turn: _Turn) -> bytes | None:
    """Fingerprint ``turn`` (kept on it for the next comparison); its messages' JSON, or None."""
    messages = turn.body.get("messages")
    if not isinstance(messages, list):
        return None
    try:
        dumped = orjson.dumps(messages)
        rest = orjson.dumps({k: v for k, v in turn.body.items() if k != "messages"})
    except TypeError:  # e.g. an integer beyond 64 bits
        return None
    turn.fingerprint = _Fingerprint(len(dumped), xxhash.xxh3_64_intdigest(dumped), rest)
    return dumped


def _extends(old: _Turn, new: _Turn) -> bool:
    """True when ``new``'s body re-sends ``old``'s byte for byte and only appends messages.

    Compared as JSON bytes (key order and number formats reach the tokens), with one serialization
    of the new body: the old turn's fingerprint was kept when it was the new one. Then no request
    part differs, and the common turn costs no splitting into parts.
    """
    if old.fingerprint is None:
        _fingerprint(old)
    dumped = _fingerprint(new)
    before, after = old.fingerprint, new.fingerprint
    if before is None or after is None or dumped is None or after.rest != before.rest:
        return False
    if len(dumped) == before.messages_len:
        return after.messages_digest == before.messages_digest
    cut = before.messages_len - 1  # the old list's bytes without its closing bracket
    if len(dumped) < before.messages_len or cut < 1 or dumped[cut] != ord(","):
        return False  # fewer bytes, or the old list does not end where a new message starts
    return xxhash.xxh3_64_intdigest(dumped[:cut] + b"]") == before.messages_digest
