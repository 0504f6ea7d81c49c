"""The README's two set-up commands are the ones the project really runs."""

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


def test_readme_documents_every_option():
    text = (ROOT / "README.md").read_text()
    for option in OPTIONS:
        assert re.search(rf"`{re.escape(option.flag)}`", text), option.flag
        assert option.env in text


def test_readme_documents_every_tokenization_key():
    from tokenization.config import TokenizerConfig

    section = (ROOT / "README.md").read_text().split("`tokenization:` section", 1)[1]
    for key in TokenizerConfig.model_fields:
        assert f"| `{key}` |" in section, key
