"""``claude_memory`` (on by default): Claude Code's ``# Memory`` section, which names a per-directory path.

Claude Code (2.x) tells the model where its file-based memory lives:
``# Memory`` / ``You have a persistent file-based memory at `~/.claude/projects/-<cwd with
dashes>/memory/`. ...`` and the instructions for using it, up to the next ``# `` heading. The path
makes the system prompt differ between sessions in different directories. The whole section moves,
byte for byte, to the newest user message (``proxy.canonical.rules.sections``): the model reads the
same text after system + tools, in the user turn; the section is instructions, so they then come
from the user's turn rather than the system prompt (``enabled: false`` keeps them there).
"""

from __future__ import annotations

import re

from proxy.canonical.rules.base import TextRule, TextStep
from proxy.canonical.rules.sections import Format, SectionSettings, section_step

NAME = "claude_memory"

FORMATS: dict[str, Format] = {
    # Claude Code 2.1 (seen on 2.1.197 and 2.1.332): the section runs to the next top-level heading.
    "claude-code-2.1": Format(
        "You have a persistent file-based memory at `",
        re.compile(
            r"^(?P<block># Memory\n\nYou have a persistent file-based memory at `[^`\n]*/\.claude/projects/"
            r"[^`\n]*/memory/`)",
            re.MULTILINE,
        ),
        to_heading="# ",
    ),
}


class ClaudeMemorySettings(SectionSettings):
    """Claude Code's ``# Memory`` section moved to the newest user message."""


def _build(settings: ClaudeMemorySettings) -> TextStep | None:
    return section_step(FORMATS, settings)


RULE = TextRule(NAME, ClaudeMemorySettings, _build)
