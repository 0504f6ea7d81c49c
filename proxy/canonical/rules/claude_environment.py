"""``claude_environment`` (on by default): Claude Code's ``# Environment`` section out of the system prompt.

Claude Code (2.x) lists its environment in the system prompt: ``# Environment``, ``You have been
invoked in the following environment:``, then `` - Primary working directory: ...``, ``Is a git
repository``, platform, shell, OS version, the model's name and more ``- `` lines. The working
directory makes the system prompt differ between sessions in different directories; the section
moves to the newest user message (``proxy.canonical.rules.sections``), so sessions of one agent
share system + tools and the model reads the same lines after them.
"""

from __future__ import annotations

import re

from proxy.canonical.rules.base import TextRule, TextStep
from proxy.canonical.rules.sections import Format, SectionSettings, section_step

NAME = "claude_environment"

FORMATS: dict[str, Format] = {
    # Claude Code 2.1 (seen on 2.1.197): the list runs while lines start with " - ".
    "claude-code-2.1": Format(
        "# Environment\nYou have been invoked in the following environment:",
        re.compile(
            r"^(?P<block># Environment\nYou have been invoked in the following environment:[ \t]*\n"
            r"(?: - [^\n]*(?:\n|\Z))+)(?:[ \t]*\n)*",
            re.MULTILINE,
        ),
    ),
}


class ClaudeEnvironmentSettings(SectionSettings):
    """Claude Code's ``# Environment`` section moved to the newest user message."""


def _build(settings: ClaudeEnvironmentSettings) -> TextStep | None:
    return section_step(FORMATS, settings)


RULE = TextRule(NAME, ClaudeEnvironmentSettings, _build)
