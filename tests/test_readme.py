"""The README is a user's manual: its two set-up commands are the ones the project really runs, it fits
in 250 lines of at most 120 characters, its links resolve, and every setting is in the reference it
links to."""

from __future__ import annotations

import re
from pathlib import Path

from proxy.config import OPTIONS

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up on a fresh machine", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in section.splitlines() if line.startswith("    ")]


def test_readme_has_exactly_two_setup_commands():
    commands = readme_commands()
    assert len(commands) == 2
    assert commands[0].endswith("prefixgate demo")


def test_ci_runs_the_readme_test_command():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert readme_commands()[1] in ci_lines


MAX_LINES, MAX_WIDTH = 250, 120
CONFIGURATION = ROOT / "docs" / "configuration.md"
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_readme_is_a_manual_of_at_most_250_lines_of_120_characters():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= MAX_LINES
    wide = [(number, len(line)) for number, line in enumerate(lines, 1) if len(line) > MAX_WIDTH]
    assert wide == []


def test_every_relative_link_of_the_readme_and_the_docs_resolves():
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target, anchor in LINK.findall(page.read_text()):
            if "://" in target:
                continue
            linked = (page.parent / target).resolve()
            assert linked.exists(), (page.name, target)
            if anchor and linked.suffix == ".md":
                assert anchor[1:] in anchors(linked.read_text()), (page.name, target + anchor)


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a page's headings."""
    headings = re.findall(r"^#+ (.+)$", markdown, re.M)
    return {re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-") for heading in headings}


def test_readme_links_the_reference_that_documents_every_option():
    assert "(docs/configuration.md)" in (ROOT / "README.md").read_text()
    text = CONFIGURATION.read_text()
    for option in OPTIONS:
        assert re.search(rf"`{re.escape(option.flag)}`", text), option.flag
        assert option.env in text


def test_the_readmes_flags_are_flags_serve_takes():
    from tests.test_config_reference import serve_flags

    section = (ROOT / "README.md").read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`(--[a-z-]+)", section))
    assert named and named <= set(serve_flags()), named - set(serve_flags())


def test_the_reference_documents_every_tokenization_key():
    from tokenization.config import TokenizerConfig

    section = CONFIGURATION.read_text().split("`tokenization:` section", 1)[1]
    for key in TokenizerConfig.model_fields:
        assert f"| `{key}` |" in section, key
