"""Text regions that the system-text rules must never edit: fenced code blocks and diff/patch hunks.

Rule 6 (whitespace) and the regex rules (5, 7) share one notion of "protected": a fenced block
(```` ``` ```` or ``~~~``, closed by a fence of the same character at least as long, or running to the
end of the text), a unified-diff hunk (from ``diff --git``, ``@@ `` or a ``--- ``/``+++ `` header pair,
while lines start with a diff marker), and an apply_patch envelope (``*** Begin Patch`` to
``*** End Patch``). Being generous here only means a rule edits less.

``extract_blocks`` takes recognised blocks out of a text while respecting those regions: the helper
for rules that move an exactly recognised section out of the system prompt (``env_block``).
"""

from __future__ import annotations

import re
from bisect import bisect_right
from collections.abc import Sequence
from typing import NamedTuple

_DIFF_LINE_STARTS = (" ", "+", "-", "@", "\\")
_DIFF_HEADER_STARTS = (
    "diff ",
    "index ",
    "Index: ",
    "new file mode",
    "deleted file mode",
    "similarity index",
    "rename from",
    "rename to",
    "old mode",
    "new mode",
    "Binary files",
)
# Cheap substring test: when none of these occur, no line can open a protected region.
_REGION_MARKERS = ("```", "~~~", "@@ ", "*** Begin Patch", "diff --git", "--- ")


def may_have_regions(text: str) -> bool:
    """False when ``text`` certainly has no fenced block, hunk or patch (the common fast path)."""
    return any(marker in text for marker in _REGION_MARKERS)


def _fence_open(line: str) -> tuple[str, int] | None:
    stripped = line.lstrip(" \t")
    if not stripped:
        return None
    char = stripped[0]
    if char not in "`~":
        return None
    run = len(stripped) - len(stripped.lstrip(char))
    return (char, run) if run >= 3 else None


def _fence_closes(line: str, char: str, run: int) -> bool:
    stripped = line.strip(" \t\r")
    return len(stripped) >= run and stripped == char * len(stripped)


def protected_line_mask(lines: list[str]) -> tuple[list[bool], bool]:
    """Per line, whether it lies in a protected region; and whether a region is still open at the end.

    ``lines`` are the text split on ``"\\n"`` (a line may keep a trailing ``"\\r"``).
    """
    mask = [False] * len(lines)
    fence: tuple[str, int] | None = None
    hunk: str | None = None  # "diff" or "patch"
    for i, line in enumerate(lines):
        if fence is not None:
            mask[i] = True
            if _fence_closes(line, fence[0], fence[1]):
                fence = None
            continue
        if hunk == "patch":
            mask[i] = True
            if line.startswith("*** End Patch"):
                hunk = None
            continue
        if hunk == "diff":
            if (line and line[0] in _DIFF_LINE_STARTS) or line.startswith(_DIFF_HEADER_STARTS):
                mask[i] = True
                continue
            hunk = None
        opened = _fence_open(line)
        if opened is not None:
            fence = opened
            mask[i] = True
        elif line.startswith("*** Begin Patch"):
            hunk = "patch"
            mask[i] = True
        elif line.startswith(("diff --git ", "@@ ")) or (
            line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ ")
        ):
            hunk = "diff"
            mask[i] = True
    return mask, fence is not None or hunk is not None


def protected_spans(text: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` of the protected regions of ``text``, in order, merged."""
    if not may_have_regions(text):
        return []
    lines = text.split("\n")
    mask, _ = protected_line_mask(lines)
    spans: list[tuple[int, int]] = []
    pos = 0
    for line, protected in zip(lines, mask, strict=True):
        end = min(pos + len(line) + 1, len(text))  # the "\n" belongs to its line
        if protected:
            if spans and spans[-1][1] == pos:
                spans[-1] = (spans[-1][0], end)
            else:
                spans.append((pos, end))
        pos = end
    return spans


def overlaps(start: int, end: int, spans: list[tuple[int, int]]) -> bool:
    """Whether ``[start, end)`` intersects one of the sorted, disjoint ``spans``."""
    if not spans:
        return False
    i = bisect_right(spans, (start, float("inf"))) - 1
    if i >= 0 and spans[i][1] > start:
        return True
    return i + 1 < len(spans) and spans[i + 1][0] < end


class Recogniser(NamedTuple):
    """An exactly recognised block: substrings that must all occur (a cheap gate), and a pattern whose
    ``block`` group is the text to take out (the whole match is removed)."""

    needles: tuple[str, ...]
    pattern: re.Pattern[str]


def extract_blocks(text: str, recognisers: Sequence[Recogniser]) -> tuple[str, tuple[str, ...]]:
    """``text`` without the recognised blocks outside protected regions, and the blocks (outer
    whitespace stripped), in text order. Where two matches overlap, the earlier one wins."""
    found: list[tuple[int, int, str]] = []
    spans: list[tuple[int, int]] | None = None
    for needles, pattern in recognisers:
        if not all(n in text for n in needles):
            continue
        for m in pattern.finditer(text):
            if spans is None:
                spans = protected_spans(text)
            if not overlaps(m.start(), m.end(), spans):
                found.append((m.start(), m.end(), m.group("block").strip("\r\n\t ")))
    return cut_out(text, found)


def cut_out(text: str, found: list[tuple[int, int, str]]) -> tuple[str, tuple[str, ...]]:
    """``text`` without the ``(start, end, block)`` spans found in it, and their blocks, in text order;
    where two spans overlap, the earlier one wins."""
    if not found:
        return text, ()
    found.sort()
    pieces: list[str] = []
    blocks: list[str] = []
    pos = 0
    for start, end, block in found:
        if start < pos:  # overlapping recognisers: the first one wins
            continue
        pieces.append(text[pos:start])
        blocks.append(block)
        pos = end
    pieces.append(text[pos:])
    return "".join(pieces), tuple(blocks)
