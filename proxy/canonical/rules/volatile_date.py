"""Rule 5, ``volatile_date``: date and time in the system prompt.

A clock in the system prompt changes the first few hundred tokens on every request (or every day),
and with them the cache of everything after. Two modes:

- ``day``: drop the time of day (the ``time`` group of a pattern), keeping the date. The prompt then
  changes at most once a day and is shared by all sessions of that day.
- ``move``: take the whole line out of the system prompt, to the newest user message
  (``Destination.NEWEST_USER``: pinned there across turns), so the system prompt never changes. A
  request with no user message gets ``day`` mode instead.

Patterns are regexes with an optional ``date`` and ``time`` group, plus literal hints that gate them;
only matches outside fenced code and diff hunks count. The defaults cover the agents of
``specs/agent-requests.md``: Goose's ``The current date is 2025-08-28 14:03:27.``,
opencode/Claude Code/Continue ``Today's date: ...``, Aider ``Current date: ...``, OpenHands
``Today's date is ... (UTC).``, Cline/Roo ``# Current Time`` blocks, Codex ``<current_date>``, and
any ISO date-time with a clock.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal

from pydantic import Field, field_validator

from proxy.canonical.rules.base import (
    Destination,
    Moved,
    RuleConfig,
    StrictModel,
    TextEdit,
    TextRule,
    TextStep,
)
from proxy.canonical.rules.text import overlaps, protected_spans

NAME = "volatile_date"

_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_MON = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)"
_LONG_MON = r"(?:January|February|March|April|May|June|July|August|September|October|November|December)"
_LONG_DAY = r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)"
_ANY_DATE = (
    r"(?:\d{4}-\d{2}-\d{2}"  # 2025-07-31
    rf"|{_DAY} {_MON} \d{{2}} \d{{4}}"  # Thu Jul 31 2025 (JavaScript toDateString)
    rf"|(?:{_LONG_DAY},? )?{_LONG_MON} \d{{1,2}},? \d{{4}}"  # Thursday, July 31, 2025
    r"|\d{1,2}/\d{1,2}/\d{2,4}"  # 7/31/2025
    r"|\d{1,2}\.\d{1,2}\.\d{4})"  # 31.07.2025
)
_CLOCK = (
    r"\d{1,2}:\d{2}(?::\d{2}(?:[.,]\d{1,9})?)?"
    r"(?:[ \u202f]?[AaPp]\.?[Mm]\.?)?"
    r"(?:Z|[+-]\d{2}:?\d{2})?"
)

# name -> (regex, hints). Plain data so that the configuration can list, replace or extend them. Hints
# are lowercase literals, one of which must occur in the lowercased text for the regex to run: a
# substring test is ~100x cheaper than a case-insensitive alternation scanned over a 40 kB prompt.
DEFAULT_PATTERNS: dict[str, tuple[str, tuple[str, ...]]] = {
    # Starts with the literal "-" (the year is a look-behind after it) so that re's fast literal
    # search does the scanning: with the look-behind first, re tried every position, 1.2-2 ms on an
    # 80 kB system prompt against 0.04 ms.
    "iso_datetime": (rf"-(?<=\d{{4}}-)\d{{2}}-\d{{2}}(?P<time>[T ]{_CLOCK})(?![\d:])", ()),
    "todays_date": (
        r"(?i:today's date|today is|the current date is|current date(?: and time)?|the date is)"
        rf"(?: is)?:?[ \t]*\**(?P<date>{_ANY_DATE})(?P<time>,?(?:[ T]| at ){_CLOCK})?",
        ("today's date", "today is", "current date", "the date is"),
    ),
    "current_time_block": (
        rf"(?m)^#* ?Current Time[ \t]*\r?\n(?P<date>{_ANY_DATE})(?P<time>,? {_CLOCK})?",
        ("current time",),
    ),
    "xml_current_date": (r"<current_date>(?P<date>[^<\n]{6,40})</current_date>", ("<current_date>",)),
}

CompiledPattern = tuple[re.Pattern[str], tuple[str, ...]]


def compile_patterns(patterns: Sequence[tuple[str, Sequence[str]]]) -> tuple[CompiledPattern, ...]:
    """Compiled ``(regex, hints)`` pairs, in the configured order."""
    return tuple((re.compile(regex), tuple(h.lower() for h in hints)) for regex, hints in patterns)


def _matches(text: str, patterns: Sequence[CompiledPattern]) -> list[re.Match[str]]:
    lowered: str | None = None
    found: list[re.Match[str]] = []
    for pattern, hints in patterns:
        if hints:
            if lowered is None:
                lowered = text.lower()
            if not any(h in lowered for h in hints):
                continue
        found.extend(m for m in pattern.finditer(text) if m.end() > m.start())
    if not found:
        return found
    spans = protected_spans(text)
    return [m for m in found if not overlaps(m.start(), m.end(), spans)]


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _cut(text: str, spans: list[tuple[int, int]]) -> str:
    pieces: list[str] = []
    pos = 0
    for start, end in spans:
        pieces.append(text[pos:start])
        pos = end
    pieces.append(text[pos:])
    return "".join(pieces)


def coarsen_dates(text: str, patterns: Sequence[CompiledPattern]) -> tuple[str, int]:
    """``day`` mode: ``text`` with the time of day removed from every match, and the count removed."""
    spans = []
    for m in _matches(text, patterns):
        if "time" in m.re.groupindex and m.group("time"):
            spans.append(m.span("time"))
    if not spans:
        return text, 0
    merged = _merge(spans)
    return _cut(text, merged), len(merged)


def extract_date_lines(text: str, patterns: Sequence[CompiledPattern]) -> tuple[str, tuple[str, ...]]:
    """``move`` mode: ``text`` without the lines that hold a match, and those lines (without indent)."""
    matches = _matches(text, patterns)
    if not matches:
        return text, ()
    line_spans = []
    for m in matches:
        start = text.rfind("\n", 0, m.start()) + 1
        end = text.find("\n", m.end() - 1 if m.group().endswith("\n") else m.end())
        end = len(text) if end < 0 else end + 1
        # Take one of the two blank lines around the moved line too, so no double gap is left behind.
        if text.startswith("\n", end) and (start == 0 or text.endswith("\n\n", 0, start)):
            end += 1
        line_spans.append((start, end))
    merged = _merge(line_spans)
    lines = tuple(
        line
        for start, end in merged
        for line in (raw.strip(" \t\r") for raw in text[start:end].split("\n"))
        if line.strip()
    )
    return _cut(text, merged), lines


class DatePattern(StrictModel):
    """A named regex for a volatile date/time; its ``time`` group is what ``day`` mode removes.

    ``hints``: literal substrings (case-insensitive), one of which must occur for the regex to run;
    empty = always run.
    """

    name: str
    regex: str
    hints: tuple[str, ...] = ()

    @field_validator("regex")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"invalid regex: {exc}") from exc
        return value


def _default_date_patterns() -> tuple[DatePattern, ...]:
    return tuple(DatePattern(name=n, regex=r, hints=h) for n, (r, h) in DEFAULT_PATTERNS.items())


class VolatileDateSettings(RuleConfig):
    """Rule 5: ``day`` coarsens to the date, ``move`` moves the line to a user message."""

    mode: Literal["day", "move"] = "day"
    patterns: tuple[DatePattern, ...] = Field(default_factory=_default_date_patterns)
    # ``move`` mode: how many (message, line) attachments a session remembers.
    max_anchors: int = Field(default=8, ge=1)


def _build(settings: VolatileDateSettings) -> TextStep | None:
    # No ``markers``: hints are case-insensitive and a pattern may have none (``iso_datetime``), so
    # the step runs on every text and gates each pattern on its hints itself.
    patterns = compile_patterns([(p.regex, p.hints) for p in settings.patterns])

    def day(text: str) -> TextEdit:
        out, n = coarsen_dates(text, patterns)
        return TextEdit(out, n)

    if settings.mode == "day":
        return TextStep(day) if patterns else None

    def move(text: str) -> TextEdit:
        out, lines = extract_date_lines(text, patterns)
        return TextEdit(out, len(lines), tuple(Moved(line, Destination.NEWEST_USER) for line in lines))

    return TextStep(move, user_anchors=settings.max_anchors, without_user=TextStep(day))


RULE = TextRule(NAME, VolatileDateSettings, _build)
