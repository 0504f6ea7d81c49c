"""``opencode_env`` (on by default): opencode's ``<env>`` block out of the system prompt.

opencode (1.x) writes, inside its one system message, ``Here is some useful information about the
environment you are running in:`` then ``<env>`` with two-space indented lines (``Working
directory:`` read from ``$PWD``, ``Workspace root folder:``, ``Is directory a git repo:``,
``Platform:``, ``Today's date:``) and ``</env>``. The working directory differs per session and the
date at midnight; the block moves to the newest user message
(``proxy.canonical.rules.sections``), so every opencode session shares system + tools and the model
reads the same lines after them. opencode 0.x sent the block (without ``Workspace root folder:``, with
a ``<project>`` tree) as a second system message, which templates already render after the tools:
that shape is not this rule's.
"""

from __future__ import annotations

import re

from proxy.canonical.rules.base import TextRule, TextStep
from proxy.canonical.rules.sections import Format, SectionSettings, section_step

NAME = "opencode_env"

_INTRO = "Here is some useful information about the environment you are running in:"

FORMATS: dict[str, Format] = {
    # opencode 1.18 (seen on 1.18.33): the intro line and the <env> element, mid system message.
    "opencode-1.18": Format(
        _INTRO + "\n<env>\n  Working directory: ",
        re.compile(
            rf"^(?P<block>{re.escape(_INTRO)}\n<env>\n  Working directory: [^\n]*\n"
            r"  Workspace root folder: [^\n]*\n(?:  [^\n]*\n)*</env>)[ \t]*(?:\n|\Z)",
            re.MULTILINE,
        ),
    ),
}


class OpencodeEnvSettings(SectionSettings):
    """opencode's ``<env>`` block moved to the newest user message."""


def _build(settings: OpencodeEnvSettings) -> TextStep | None:
    return section_step(FORMATS, settings)


RULE = TextRule(NAME, OpencodeEnvSettings, _build)
