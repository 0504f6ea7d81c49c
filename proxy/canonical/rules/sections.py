"""The helper of the rules that move an agent's volatile section out of its system prompt.

Claude Code's ``gitStatus``, ``# Environment`` and ``# Memory`` sections and opencode's ``<env>``
block each make the system prompt (and, on templates that render the tools inside the system turn,
the whole tool block after it) differ between processes of one session and between sessions. A
rule recognises its agent's exact section, per agent version (``Format``: a regex whose ``block``
group is the section, or a heading whose section runs to the next heading), takes it out of the
system text and pins it to the newest user message (``Destination.NEWEST_USER``): on a session's
first request that is the first user message, right after system + tools; later turns re-attach it
there, so the history stays byte-stable, and a section that changed (a file edited between
``--continue`` prompts) goes to the newest user message of the request that brought it. A request
with no user message gets the section in a user message right after the system messages. The
section joins the message's last text part (``TextStep.joined``): Claude Code sends a message's
content as text parts, later as a string, and both then render alike. Sections are pinned one by one
(known by their first line): when only the git status changes, only it is attached anew.

The section's text is kept byte for byte; only whitespace around it (the blank lines that set it
apart) is dropped. A match that starts or ends inside a fenced block or a diff is left alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import Field

from proxy.canonical.rules.base import Destination, Moved, RuleConfig, TextEdit, TextStep
from proxy.canonical.rules.text import cut_out, protected_spans

#: (message, text) attachments a session remembers per rule set (see ``TextStep.user_anchors``):
#: one per section at first, one more each time a section changes; past it the oldest go (and with
#: them those sections' bytes from the history), so it is generous.
MAX_ANCHORS = 32


@dataclass(frozen=True, slots=True)
class Format:
    """One agent version's section: a literal that must occur (the cheap gate) and a pattern whose
    ``block`` group is the section (the whole match is taken out). ``to_heading``: the section runs
    from the match to the next line starting with that heading prefix (or the end of the text)."""

    needle: str
    pattern: re.Pattern[str]
    to_heading: str | None = None


class SectionSettings(RuleConfig):
    """Which agent versions' formats are recognised (all by default)."""

    versions: tuple[str, ...] | None = None
    max_anchors: int = Field(default=MAX_ANCHORS, ge=1)


def _inside(pos: int, spans: Sequence[tuple[int, int]]) -> bool:
    return any(start < pos < end for start, end in spans)


def _find(text: str, fmt: Format, spans: list[tuple[int, int]] | None) -> tuple[int, int, str] | None:
    """The first occurrence of ``fmt`` in ``text`` outside protected regions: (start, end, block)."""
    for m in fmt.pattern.finditer(text):
        start, end, block = m.start(), m.end(), m.group("block")
        if spans is None:
            spans = protected_spans(text)
        if fmt.to_heading is not None:
            nxt = text.find("\n" + fmt.to_heading, m.end("block") - 1)
            while nxt != -1 and _inside(nxt + 1, spans):
                nxt = text.find("\n" + fmt.to_heading, nxt + 1)
            end = len(text) if nxt == -1 else nxt + 1
            block = text[m.start("block") : end]
        if not (_inside(start, spans) or _inside(end, spans)):
            return start, end, block.strip("\r\n\t ")
    return None


def move_sections(text: str, formats: Sequence[Format]) -> tuple[str, tuple[str, ...]]:
    """``text`` without its recognised sections, and the sections, in text order (one per format)."""
    found: list[tuple[int, int, str]] = []
    for fmt in formats:
        if fmt.needle in text and (hit := _find(text, fmt, None)) is not None:
            found.append(hit)
    out, blocks = cut_out(text, found)
    if blocks and not text.endswith("\n"):  # a section cut from the end leaves no dangling blank lines
        out = out.rstrip("\r\n")
    return out, tuple(blocks)


def section_step(formats: Mapping[str, Format], settings: SectionSettings) -> TextStep | None:
    """The step moving the sections of the selected versions to the newest user message."""
    chosen = [
        fmt for version, fmt in formats.items() if settings.versions is None or version in settings.versions
    ]
    if not chosen:
        return None

    def run(text: str) -> TextEdit:
        out, blocks = move_sections(text, chosen)
        return TextEdit(out, len(blocks), tuple(Moved(b, Destination.NEWEST_USER) for b in blocks))

    # a format only matches where its needle occurs
    markers = tuple(fmt.needle for fmt in chosen)
    return TextStep(run, user_anchors=settings.max_anchors, joined=True, markers=markers)
