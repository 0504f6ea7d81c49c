"""Unit tests of the system-text rules: attribution (4), volatile_date (5), whitespace (6), env_block (7)."""

from __future__ import annotations

import pytest

from proxy.canonical.rules.attribution import DEFAULT_HEADERS, compile_headers, strip_attribution
from proxy.canonical.rules.env_block import extract_env_blocks
from proxy.canonical.rules.text import protected_line_mask, protected_spans
from proxy.canonical.rules.volatile_date import (
    DEFAULT_PATTERNS,
    coarsen_dates,
    compile_patterns,
    extract_date_lines,
)
from proxy.canonical.rules.whitespace import normalize_whitespace

BILLING = compile_headers(DEFAULT_HEADERS)
DATES = compile_patterns(list(DEFAULT_PATTERNS.values()))
NO_HINTS = compile_patterns([(regex, ()) for regex, _ in DEFAULT_PATTERNS.values()])


def strip(text: str) -> tuple[str, int]:
    return strip_attribution(text, BILLING, DEFAULT_HEADERS)


# --- rule 4 ---------------------------------------------------------------------------------------------
def test_billing_line_alone_is_removed_with_its_newline() -> None:
    text = (
        "x-anthropic-billing-header: cc_version=2.1.30.4c1; cc_entrypoint=cli; cch=5d21e;\nYou are helpful."
    )
    assert strip(text) == ("You are helpful.", 1)


def test_billing_header_glued_to_prompt_text_removes_only_the_header() -> None:
    text = "x-anthropic-billing-header: cc_version=2.1.30.4c1; cc_entrypoint=sdk-cli; You are helpful."
    assert strip(text) == ("You are helpful.", 1)


def test_billing_header_without_final_semicolon_and_as_whole_text() -> None:
    assert strip("x-anthropic-billing-header: cc_version=2.1.181.73f; cc_entrypoint=cli") == ("", 1)
    assert strip("x-anthropic-billing-header: cc_version=1.0.0.abc;") == ("", 1)


@pytest.mark.parametrize(
    "text",
    [
        "Mention x-anthropic-billing-header: cc_version=1; in the middle of a line.",
        "x-anthropic-billing-header: no pairs here",
        "X-Other-Header: a=b;",
    ],
)
def test_attribution_leaves_lookalikes_alone(text: str) -> None:
    assert strip(text) == (text, 0)


# --- rule 5 ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("text", "day"),
    [
        ("The current date is 2025-08-28 14:03:27.", "The current date is 2025-08-28."),
        ("Now: 2025-08-28T14:03:27.512Z end", "Now: 2025-08-28 end"),
        ("Today's date: 2025-07-31 09:15", "Today's date: 2025-07-31"),
        (
            "# Current Time\n11/3/2025, 9:14:07 AM (Europe/Berlin, UTC+1:00)",
            "# Current Time\n11/3/2025 (Europe/Berlin, UTC+1:00)",
        ),
        (
            "Current date and time: Thursday, July 31, 2025 at 9:15 PM",
            "Current date and time: Thursday, July 31, 2025",
        ),
    ],
)
def test_day_mode_drops_the_clock(text: str, day: str) -> None:
    out, n = coarsen_dates(text, DATES)
    assert (out, n) == (day, 1)
    assert coarsen_dates(out, DATES) == (out, 0)


@pytest.mark.parametrize(
    "text",
    [
        "  Today's date: Thu Jul 31 2025",
        "- Current date: 2025-11-03",
        "Today's date is 2025-11-28 (UTC).",
        "<current_date>2025-11-03</current_date>",
        "Version 2025-01-01 of the spec applies.",  # a bare date is not a clock: nothing to coarsen
    ],
)
def test_day_mode_leaves_day_granular_dates(text: str) -> None:
    assert coarsen_dates(text, DATES) == (text, 0)


def test_move_mode_takes_whole_lines_out_and_closes_the_gap() -> None:
    text = (
        "Intro.\n\nThe current date is 2025-08-28 14:03:27.\n\nRules follow.\n"
        "  Today's date: Thu Jul 31 2025\nEnd."
    )
    out, lines = extract_date_lines(text, DATES)
    assert out == "Intro.\n\nRules follow.\nEnd."
    assert lines == ("The current date is 2025-08-28 14:03:27.", "Today's date: Thu Jul 31 2025")
    assert extract_date_lines(out, DATES) == (out, ())


def test_dates_inside_fenced_code_are_left_alone() -> None:
    text = "Example log:\n```\n2025-08-28 14:03:27 started\n```\nThe current date is 2025-08-28 14:03:27."
    out, n = coarsen_dates(text, DATES)
    assert n == 1
    assert out == "Example log:\n```\n2025-08-28 14:03:27 started\n```\nThe current date is 2025-08-28."
    moved, lines = extract_date_lines(text, DATES)
    assert lines == ("The current date is 2025-08-28 14:03:27.",)
    assert "2025-08-28 14:03:27 started" in moved


# --- rule 6 ---------------------------------------------------------------------------------------------
def test_whitespace_crlf_trailing_blanks_and_final_newline() -> None:
    assert normalize_whitespace("a  \r\nb\t\r\n\r\n\r\n") == ("a\nb\n", 1)
    assert normalize_whitespace("a\nb") == ("a\nb\n", 1)
    assert normalize_whitespace("a\nb\n") == ("a\nb\n", 0)
    assert normalize_whitespace("a\nb\n\n", final_newline="strip") == ("a\nb", 1)
    assert normalize_whitespace("a\nb\n\n", final_newline="keep") == ("a\nb\n\n", 0)
    assert normalize_whitespace("") == ("", 0)


def test_whitespace_nfc_and_indentation() -> None:
    decomposed = "Cafe\u0301 menu\n    indented  \n"
    out, n = normalize_whitespace(decomposed)
    assert (out, n) == ("Caf\u00e9 menu\n    indented\n", 1)
    assert normalize_whitespace(decomposed, nfc=False)[0] == "Cafe\u0301 menu\n    indented\n"


def test_whitespace_never_touches_code_diff_or_patch() -> None:
    text = (
        "Intro.  \n"
        "```python\nx = 1   \r\n\n```\n"
        "diff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n ctx  \n \n-old \n+new \n"
        "After the diff.  \n"
        "*** Begin Patch\n*** Update File: f\n@@\n \n-a \n+b \n*** End Patch\n"
        "Tail.  "
    )
    out, n = normalize_whitespace(text)
    assert n == 1
    expected = (
        "Intro.\n"
        "```python\nx = 1   \r\n\n```\n"
        "diff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -1,3 +1,3 @@\n ctx  \n \n-old \n+new \n"
        "After the diff.\n"
        "*** Begin Patch\n*** Update File: f\n@@\n \n-a \n+b \n*** End Patch\n"
        "Tail.\n"
    )
    assert out == expected
    assert normalize_whitespace(out) == (out, 0)


def test_text_ending_inside_an_open_hunk_keeps_its_ending() -> None:
    text = "See:\n@@ -1 +1 @@\n-a\n+b \n \n"
    assert normalize_whitespace(text) == (text, 0)


def test_protected_regions() -> None:
    lines = ["a", "~~~~", "```", "~~~", "~~~~", "b", "--- x", "+++ y", "@@", "c"]
    mask, open_at_end = protected_line_mask(lines)
    assert mask == [False, True, True, True, True, False, True, True, True, False]
    assert not open_at_end
    assert protected_spans("a\n```\nb\n") == [(2, 8)]
    assert protected_spans("plain text") == []


# --- rule 7 ---------------------------------------------------------------------------------------------
def test_env_tag_block_with_intro_and_project_tree() -> None:
    text = (
        "Static part.\n"
        "Here is some useful information about the environment you are running in:\n"
        "<env>\n  Working directory: /srv/app\n  Platform: linux\n</env>\n"
        "<project>\n  app/\n\tmain.py\n</project>\n"
        "More static text."
    )
    out, blocks = extract_env_blocks(text, ["env_tag"])
    assert out == "Static part.\nMore static text."
    assert blocks == (
        "Here is some useful information about the environment you are running in:\n"
        "<env>\n  Working directory: /srv/app\n  Platform: linux\n</env>\n"
        "<project>\n  app/\n\tmain.py\n</project>",
    )
    assert extract_env_blocks(out, ["env_tag"]) == (out, ())


def test_cline_system_information_section() -> None:
    text = (
        "RULES\n\n- be nice\n\n====\n\nSYSTEM INFORMATION\n\n"
        "Operating System: Linux\nDefault Shell: /bin/bash\n\n"
        "====\n\nOBJECTIVE\n\nDo it."
    )
    out, blocks = extract_env_blocks(text, ["cline_system_information"])
    assert out == "RULES\n\n- be nice\n\n====\n\nOBJECTIVE\n\nDo it."
    assert blocks == ("SYSTEM INFORMATION\n\nOperating System: Linux\nDefault Shell: /bin/bash",)


def test_env_block_not_recognised_inside_code_or_when_unclosed() -> None:
    fenced = "Example:\n```\n<env>\nx\n</env>\n```\n"
    assert extract_env_blocks(fenced, ["env_tag", "cline_system_information"]) == (fenced, ())
    unclosed = "<env>\nx\n"
    assert extract_env_blocks(unclosed, ["env_tag"]) == (unclosed, ())


@pytest.mark.parametrize(
    "text",
    [
        "The current date is 2025-08-28 14:03:27.",
        "TODAY'S DATE: 2025-07-31 09:15",
        "# Current Time\n11/3/2025, 9:14:07 AM",
        "Today is Thursday, July 31, 2025 at 9:15 PM.",
        "a 2025-08-28T14:03 b <current_date>2025-11-03</current_date>",
    ],
)
def test_hints_never_hide_a_match(text: str) -> None:
    assert coarsen_dates(text, DATES) == coarsen_dates(text, NO_HINTS)
    assert extract_date_lines(text, DATES) == extract_date_lines(text, NO_HINTS)
