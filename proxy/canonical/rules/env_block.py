"""Rule 7, ``env_block`` (opt-in): per-session environment blocks out of the system prompt.

cwd, platform, OS and git state make the system prompt (and, on templates that render tools inside
the system turn, the tool block) unique per session. Moving the recognised block to a user message
right after the system messages lets every session of an agent share system + tools. It changes what
the model reads where, so it is off by default and only exact, known shapes are recognised:

- ``env_tag``: an ``<env>...</env>`` element (opencode, Claude Code), with the introducing line just
  before it when that line ends in ``:``, and a directly following ``<project>...</project>`` tree
  (opencode);
- ``cline_system_information``: Cline's ``SYSTEM INFORMATION`` section (with the ``====`` separator
  before it) up to the next blank line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from proxy.canonical.rules._text import overlaps, protected_spans

NAME = "env_block"

# name -> (substrings that must all occur, pattern with a ``block`` group: the text to move).
RECOGNISERS: dict[str, tuple[tuple[str, ...], re.Pattern[str]]] = {
    "env_tag": (
        ("<env>", "</env>"),
        re.compile(
            r"^(?P<block>(?:[^\n<]*:[ \t]*\r?\n)?<env>[ \t]*\r?\n(?:.*?\n)??</env>[ \t]*"
            r"(?:\r?\n<project>[ \t]*\r?\n(?:.*?\n)??</project>[ \t]*)?)(?:\r?\n|\Z)",
            re.MULTILINE | re.DOTALL,
        ),
    ),
    "cline_system_information": (
        ("SYSTEM INFORMATION",),
        re.compile(
            r"^(?:====[ \t]*\r?\n[ \t]*\r?\n)?"
            r"(?P<block>SYSTEM INFORMATION[ \t]*\r?\n(?:[ \t]*\r?\n)?(?:[^\n]*\S[^\n]*(?:\n|\Z))+)"
            r"(?:[ \t]*\r?\n)*",
            re.MULTILINE,
        ),
    ),
}

BLOCK_NAMES: tuple[str, ...] = tuple(RECOGNISERS)


def extract_env_blocks(text: str, names: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """``text`` without the recognised blocks, and the blocks (outer whitespace stripped), in text order."""
    found: list[tuple[int, int, str]] = []
    spans: list[tuple[int, int]] | None = None
    for name in names:
        needles, pattern = RECOGNISERS[name]
        if not all(n in text for n in needles):
            continue
        for m in pattern.finditer(text):
            if spans is None:
                spans = protected_spans(text)
            if not overlaps(m.start(), m.end(), spans):
                found.append((m.start(), m.end(), m.group("block").strip("\r\n\t ")))
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
