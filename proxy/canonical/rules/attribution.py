"""Rule 4, ``attribution_line``: drop known non-semantic attribution lines from system text.

Claude Code puts ``x-anthropic-billing-header: cc_version=2.1.37.a1f; cc_entrypoint=cli; cch=3f9c2;``
first in its system prompt; the version suffix and ``cch`` change per request, so every request
misses the cache from token 0. The header is a run of ``key=value;`` pairs after a known name at the
start of a line. When it is alone on its line the line goes; when a converter glued it to the prompt
text on the same line, only the header goes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from proxy.canonical.rules.base import RuleConfig, TextEdit, TextRule, TextStep

NAME = "attribution_line"

DEFAULT_HEADERS: tuple[str, ...] = ("x-anthropic-billing-header",)

_PAIR = r"[ \t]*[A-Za-z_][\w.-]*=[^;\n]*;"
_LAST_PAIR = r"(?:[ \t]*[A-Za-z_][\w.-]*=[^;\n]*?)?"


def compile_headers(headers: Sequence[str]) -> re.Pattern[str] | None:
    """The line pattern for these header names, or None when there are none."""
    if not headers:
        return None
    names = "|".join(re.escape(h) for h in headers)
    return re.compile(
        rf"^(?:{names}):(?:{_PAIR})+(?:{_LAST_PAIR}[ \t]*(?:\r?\n|\Z)|[ \t]+(?=\S))",
        re.MULTILINE,
    )


def strip_attribution(text: str, pattern: re.Pattern[str] | None, headers: Sequence[str]) -> tuple[str, int]:
    """``text`` without attribution headers, and how many were removed."""
    if pattern is None or not any(h in text for h in headers):
        return text, 0
    total = 0
    while True:  # a header glued to another one only surfaces at a line start once the first is gone
        text, n = pattern.subn("", text)
        if not n:
            return text, total
        total += n


class AttributionLineSettings(RuleConfig):
    """Rule 4: header names whose ``name: k=v; ...`` lines are removed from system text."""

    headers: tuple[str, ...] = DEFAULT_HEADERS


def _build(settings: AttributionLineSettings) -> TextStep | None:
    headers = settings.headers
    pattern = compile_headers(headers)
    if pattern is None:
        return None  # no header names: nothing to strip

    def run(text: str) -> TextEdit:
        out, n = strip_attribution(text, pattern, headers)
        return TextEdit(out, n)

    return TextStep(run, markers=headers)  # a header is only stripped where its name occurs


RULE = TextRule(NAME, AttributionLineSettings, _build)
