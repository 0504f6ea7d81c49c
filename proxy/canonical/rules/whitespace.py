"""Rule 6, ``whitespace``: hygiene of system text.

CRLF to LF, no trailing spaces or tabs, Unicode NFC, and a fixed final-newline policy. Lines inside
fenced code, diff hunks and apply_patch envelopes are left byte for byte (a diff context line for an
empty line is a single space, and a patch may need its CRs). Indentation is never touched.
"""

from __future__ import annotations

import unicodedata
from typing import Literal

from proxy.canonical.rules.base import RuleConfig, TextEdit, TextRule, TextStep
from proxy.canonical.rules.text import protected_line_mask

NAME = "whitespace"

FinalNewline = Literal["one", "strip", "keep"]


def has_trailing_whitespace(text: str) -> bool:
    """Whether a line of ``text`` ends in spaces or tabs: four substring tests, where a regex for a
    run of them before a newline or the end tried every space of the text (1 ms on an 80 kB system
    prompt of prose)."""
    return " \n" in text or "\t\n" in text or text.endswith((" ", "\t"))


def _final_newline_ok(text: str, final_newline: FinalNewline) -> bool:
    if final_newline == "keep" or not text:
        return True
    if final_newline == "one":
        return text.endswith("\n") and not text.endswith("\n\n")
    return not text.endswith("\n")


def _is_clean(text: str, final_newline: FinalNewline, nfc: bool) -> bool:
    return (
        "\r" not in text
        and not has_trailing_whitespace(text)
        and _final_newline_ok(text, final_newline)
        and (not nfc or text.isascii() or unicodedata.is_normalized("NFC", text))
    )


def normalize_whitespace(
    text: str, *, final_newline: FinalNewline = "one", nfc: bool = True
) -> tuple[str, int]:
    """``text`` with whitespace hygiene applied, and 1 if it changed (else 0)."""
    if _is_clean(text, final_newline, nfc):
        return text, 0
    lines = text.split("\n")
    mask, open_at_end = protected_line_mask(lines)
    out: list[str] = []
    for line, protected in zip(lines, mask, strict=True):
        if protected:
            out.append(line)
            continue
        clean = line.rstrip(" \t\r")
        if nfc and not clean.isascii():
            clean = unicodedata.normalize("NFC", clean)
        out.append(clean)
    result = "\n".join(out)
    # A text that ends inside code or a patch keeps its ending: the final newline may be content.
    if final_newline != "keep" and not open_at_end:
        body = result.rstrip("\n")
        result = body + "\n" if final_newline == "one" and body else body
    return result, int(result != text)


class WhitespaceSettings(RuleConfig):
    """Rule 6: CRLF, trailing blanks, NFC and the final newline of system text."""

    # "keep": agents send their final newline consistently; forcing one would rewrite every request.
    final_newline: FinalNewline = "keep"
    nfc: bool = True


def _build(settings: WhitespaceSettings) -> TextStep:
    # No ``markers``: any text may need its hygiene (``_is_clean`` is the cheap test).
    final_newline, nfc = settings.final_newline, settings.nfc

    def run(text: str) -> TextEdit:
        out, n = normalize_whitespace(text, final_newline=final_newline, nfc=nfc)
        return TextEdit(out, n)

    return TextStep(run)


RULE = TextRule(NAME, WhitespaceSettings, _build)
