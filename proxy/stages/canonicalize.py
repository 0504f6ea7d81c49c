"""Stage 3, canonicalize: make the system prompt and tools byte-stable across turns, and send the
rank a body it changed as the client's bytes with only the changed values re-serialized in place.

Runs the rule engine of ``proxy/canonical/`` over the API's chat-shaped view of the request (for
chat, the body itself) and maps the rewrites back into the API's own fields. What a rule remembers
per session (first-seen tool order, where moved date lines went) lives in the session's local state
(``proxy.state.local``). A request that no rule changes is forwarded as the client's own bytes. Off
globally with ``--no-canonicalize``, per request with the header ``x-prefixgate-canonicalize: off``.

The bytes sent upstream for a body canonicalization changed (``upstream_body``): canonicalization
rewrites a few values (the leading system messages, the tools) and keeps the other objects of the
parsed body as they were, so what changed is found by identity: top-level values, and for a list
(``messages``) the run of elements between its unchanged head and tail. Their byte spans are found
by scanning the raw JSON from the start, hopping over strings with ``bytes.find``, and only as far as
the last changed value: nothing here passes over the whole body (one pass over 400 KB of JSON costs
more than orjson serializing it). When that would scan more than serializing the body costs
(``upstream_bytes``: a changed value behind a large unchanged one, any change in a small body), a
key is added, removed or repeated before the last changed one, or anything looks unexpected, the
whole body is serialized instead.

A top-level key repeated *after* the last changed value is not looked for (that would take the pass
over the body): the parse kept that later value, canonicalized it, and the splice edits the first
occurrence, so the rank, reading the last one like any JSON parser, gets the client's own value,
exactly as with canonicalization off for that request.
"""

from __future__ import annotations

import operator
import re
from itertools import takewhile
from typing import Any

import orjson

from proxy.canonical import CanonicalConfig, Canonicalizer
from proxy.context import RequestContext
from proxy.ops.metrics import Metrics

OFF_HEADER = "x-prefixgate-canonicalize"
DEBUG_HEADER = "x-prefixgate-canonical-rewrites"


class Canonicalize:
    """Rewrites ``ctx.body`` into its canonical form when a rule applies (``ctx.body_changed``,
    ``ctx.rewrites``); does nothing when ``canonicalizer`` is None (off)."""

    def __init__(self, canonicalizer: Canonicalizer | None, metrics: Metrics) -> None:
        self.canonicalizer = canonicalizer
        self.metrics = metrics

    @classmethod
    def from_settings(cls, enabled: bool, config: dict[str, Any], metrics: Metrics) -> Canonicalize:
        canonicalizer = Canonicalizer(CanonicalConfig.model_validate(config)) if enabled else None
        return cls(canonicalizer, metrics)

    def __call__(self, ctx: RequestContext) -> None:
        canonicalizer = self.canonicalizer
        if canonicalizer is None or ctx.headers.get(OFF_HEADER, "").lower() == "off":
            return
        view = ctx.api.canon_view(ctx.body)
        if view is None:
            return
        result = canonicalizer.apply(
            view,
            api="chat",
            session=thread.canon if (thread := ctx.conversation) is not None else None,
            model=ctx.model,
            client_label=ctx.client_label,
        )
        if not result.changed:
            return
        ctx.rewrites = result.rewrites
        counter = self.metrics.canonical_rewrites
        for rule, count in result.rewrites.items():
            counter.labels(rule).inc(count)
        ctx.body = ctx.api.from_canon_view(ctx.body, view, result.body)
        ctx.body_changed = True


def rewrites_header(rewrites: dict[str, int]) -> str:
    """``rule=count`` pairs for the debug response header."""
    return ",".join(f"{rule}={count}" for rule, count in sorted(rewrites.items()))


def upstream_body(ctx: RequestContext) -> bytes:
    """The bytes sent to the rank: the client's own, with what canonicalization changed
    re-serialized in place (``upstream_bytes``), or the whole body when that cannot be."""
    if not ctx.body_changed:
        return ctx.raw_body
    if ctx.client_body is not None:
        return upstream_bytes(ctx.raw_body, ctx.client_body, ctx.body)
    return orjson.dumps(ctx.body)


# -- the splice: the changed values' bytes found in the client's and re-serialized in place

#: Structural bytes the scanner stops at (strings are skipped whole).
_NEXT = re.compile(rb'["{}\[\],:]')
_WS = re.compile(rb"[ \t\n\r]*")
#: Tokens (strings, brackets, separators) scanned at most before giving up on splicing.
SCAN_BUDGET = 4096
#: A token scanned here costs about what orjson takes to serialize this many bytes of body (~1.2 us a
#: token against ~2.9 KB a us on a 400 KB chat body): ``upstream_bytes`` scans a body only as far as
#: serializing it whole would cost.
SERIALIZED_BYTES_PER_SCANNED_TOKEN = 3000


class _Unsplicable(Exception):
    pass


class _Scanner:
    __slots__ = ("budget", "raw")

    def __init__(self, raw: bytes, budget: int) -> None:
        self.raw = raw
        self.budget = budget

    def ws(self, i: int) -> int:
        end = _WS.match(self.raw, i)
        assert end is not None  # the pattern matches the empty string
        return end.end()

    def expect(self, i: int, byte: int) -> int:
        i = self.ws(i)
        if i >= len(self.raw) or self.raw[i] != byte:
            raise _Unsplicable
        return i + 1

    def string_end(self, i: int) -> int:
        """End of the string starting at ``i`` (its opening quote)."""
        raw = self.raw
        j = i + 1
        while True:
            j = raw.find(b'"', j)
            if j < 0:
                raise _Unsplicable
            k = j - 1
            while raw[k] == 0x5C:  # backslashes before the quote: an odd count escapes it
                k -= 1
            if (j - 1 - k) % 2 == 0:
                return j + 1
            j += 1

    def value_end(self, i: int) -> int:
        """End of the JSON value starting at ``i`` (no leading whitespace)."""
        self.budget -= 1
        if self.budget < 0:
            raise _Unsplicable
        raw = self.raw
        c = raw[i]
        if c == 0x22:  # "
            return self.string_end(i)
        if c not in (0x7B, 0x5B):  # a number, true, false or null: up to the next separator
            found = _NEXT.search(raw, i)
            return len(raw) if found is None else len(raw[i : found.start()].rstrip()) + i
        depth = 0
        j = i
        while True:
            found = _NEXT.search(raw, j)
            if found is None:
                raise _Unsplicable
            j = found.start()
            c = raw[j]
            if c == 0x22:
                j = self.string_end(j)
                continue
            self.budget -= 1
            if self.budget < 0:
                raise _Unsplicable
            if c in (0x7B, 0x5B):
                depth += 1
            elif c in (0x7D, 0x5D):
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1

    def members(self, wanted: set[str]) -> dict[str, int]:
        """Where the values of the top-level keys in ``wanted`` start, scanning no further than the
        start of the last of them."""
        raw = self.raw
        i = self.expect(0, 0x7B)
        starts: dict[str, int] = {}
        seen: set[str] = set()
        while True:
            i = self.ws(i)
            if raw[i] != 0x22:
                raise _Unsplicable
            key_end = self.string_end(i)
            key = orjson.loads(raw[i:key_end])
            if key in seen:
                raise _Unsplicable  # repeated: the parse kept a later value than this one
            seen.add(key)
            i = self.ws(self.expect(key_end, 0x3A))
            if key in wanted:
                starts[key] = i
                if len(starts) == len(wanted):
                    return starts
            i = self.expect(self.value_end(i), 0x2C)

    def elements(self, start: int, count: int) -> list[tuple[int, int]]:
        """Spans of the first ``count`` elements of the array starting at ``start``."""
        raw = self.raw
        i = self.expect(start, 0x5B)
        out: list[tuple[int, int]] = []
        while len(out) < count:
            i = self.ws(i)
            end = self.value_end(i)
            out.append((i, end))
            i = self.ws(end)
            if raw[i] == 0x2C:
                i += 1
            elif raw[i] != 0x5D or len(out) < count:
                raise _Unsplicable
        return out


def upstream_bytes(raw: bytes, before: dict[str, Any], after: dict[str, Any]) -> bytes:
    """``after`` as JSON, the cheaper way: spliced into ``raw`` (the client's encoding of ``before``)
    when that scans less than serializing ``after`` whole would cost, else serialized whole. A 25 KB
    body whose tools changed took ~0.4 ms to splice against ~0.01 ms to serialize; a 400 KB one
    whose system message changed splices in less than it serializes."""
    budget = min(SCAN_BUDGET, len(raw) // SERIALIZED_BYTES_PER_SCANNED_TOKEN)
    if budget > 0:
        spliced = spliced_body(raw, before, after, budget)
        if spliced is not None:
            return spliced
    return orjson.dumps(after)


def spliced_body(
    raw: bytes, before: dict[str, Any], after: dict[str, Any], budget: int = SCAN_BUDGET
) -> bytes | None:
    """``after`` as JSON: ``raw`` (the client's encoding of ``before``) with the values that are not
    the same objects in ``after`` re-serialized; None when splicing is not certain or would scan more
    than ``budget`` tokens."""
    if after.keys() != before.keys():
        return None
    changed = {k for k, v in after.items() if v is not before[k]}
    if not changed:
        return raw
    try:
        scanner = _Scanner(raw, budget)
        starts = scanner.members(changed)
        edits = [_edit(scanner, starts[key], before[key], after[key]) for key in changed]
    except (_Unsplicable, IndexError, orjson.JSONDecodeError):
        return None
    edits.sort()
    pieces: list[bytes | memoryview] = []
    view = memoryview(raw)
    at = 0
    for start, end, text in edits:
        pieces += (view[at:start], text)
        at = end
    pieces.append(view[at:])
    return b"".join(pieces)


def _edit(scanner: _Scanner, start: int, old: Any, new: Any) -> tuple[int, int, bytes]:
    """The replacement of ``old``'s bytes (its value starts at ``start``) that makes it ``new``:
    for two lists, only the run of elements between their common head and tail (by identity)."""
    if not isinstance(old, list) or not isinstance(new, list) or not old or not new:
        return start, scanner.value_end(start), orjson.dumps(new)
    head = _same_run(old, new)
    tail = min(_same_run(old[::-1], new[::-1]), min(len(old), len(new)) - head)
    old_end, new_end = len(old) - tail, len(new) - tail
    if head == old_end == new_end:  # another list of the very same elements
        return start, start, b""
    middle = b",".join(orjson.dumps(v) for v in new[head:new_end])
    if head < old_end and head < new_end:  # replaced: from the first changed element to the last
        spans = scanner.elements(start, old_end)
        return spans[head][0], spans[old_end - 1][1], middle
    if head == old_end:  # inserted before old[head], or appended after the last element
        if head < len(old):
            at = scanner.elements(start, head + 1)[head][0]
            return at, at, middle + b","
        at = scanner.elements(start, head)[head - 1][1]
        return at, at, b"," + middle
    # removed: old[head:old_end], with the comma after them (or before them, at the end)
    if old_end < len(old):
        spans = scanner.elements(start, old_end + 1)
        return spans[head][0], spans[old_end][0], b""
    spans = scanner.elements(start, old_end)
    return spans[head - 1][1], spans[old_end - 1][1], b""


def _same_run(a: list[Any], b: list[Any]) -> int:
    """How many leading elements ``a`` and ``b`` share by identity (C-level: no step per element)."""
    return len(list(takewhile(bool, map(operator.is_, a, b))))
