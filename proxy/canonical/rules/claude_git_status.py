"""``claude_git_status`` (on by default): Claude Code's ``gitStatus`` section out of the system prompt.

In a git repository Claude Code (2.x) ends its system prompt with the status read when the process
started: ``gitStatus: This is the git status at the start of the conversation. ...``, then
``Current branch:``, ``Main branch ...:``, ``Status:`` with one line per changed file (or
``(clean)``), ``Recent commits:``. Every new process (``--continue``, ``--resume``, ``claude -p``)
re-reads it, so one file edited between prompts changes the system prompt and, on templates that
render the tools after the system text, the whole tool block. The section moves to the newest user
message (``proxy.canonical.rules.sections``): the model reads the same text after system + tools.
"""

from __future__ import annotations

import re

from proxy.canonical.rules.base import TextRule, TextStep
from proxy.canonical.rules.sections import Format, SectionSettings, section_step

NAME = "claude_git_status"

FORMATS: dict[str, Format] = {
    # Claude Code 2.1 (seen on 2.1.197): blank-line separated fields, the commits last.
    "claude-code-2.1": Format(
        "gitStatus: This is the git status at the start of the conversation.",
        re.compile(
            r"(?:\n[ \t]*)*(?:^|(?<=\n))(?P<block>gitStatus: This is the git status at the start of the "
            r"conversation\. [^\n]*\n\nCurrent branch: [^\n]*\n\n(?:[A-Z][^\n]*: [^\n]*\n\n)*?"
            r"Status:\n(?:[^\n]+\n)+\nRecent commits:\n(?:[^\n]+(?:\n|\Z))*)",
            re.MULTILINE,
        ),
    ),
}


class ClaudeGitStatusSettings(SectionSettings):
    """Claude Code's ``gitStatus`` section moved to the newest user message."""


def _build(settings: ClaudeGitStatusSettings) -> TextStep | None:
    return section_step(FORMATS, settings)


RULE = TextRule(NAME, ClaudeGitStatusSettings, _build)
