"""Rule 7, ``env_block`` (opt-in): per-session environment blocks out of the system prompt.

cwd, platform, OS and git state make the system prompt (and, on templates that render tools inside
the system turn, the tool block) unique per session. Moving the recognised block to a user message
right after the system messages (``Destination.AFTER_SYSTEM``) lets every session of an agent share
system + tools. It changes what the model reads where, so it is off by default and only exact, known
shapes are recognised:

- ``env_tag``: an ``<env>...</env>`` element (opencode, Claude Code), with the introducing line just
  before it when that line ends in ``:``, and a directly following ``<project>...</project>`` tree
  (opencode);
- ``cline_system_information``: Cline's ``SYSTEM INFORMATION`` section (with the ``====`` separator
  before it) up to the next blank line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Literal, get_args

from proxy.canonical.rules.base import Destination, Moved, RuleConfig, TextEdit, TextRule, TextStep
from proxy.canonical.rules.text import Recogniser, extract_blocks

NAME = "env_block"

BlockName = Literal["env_tag", "cline_system_information"]

RECOGNISERS: dict[str, Recogniser] = {
    "env_tag": Recogniser(
        ("<env>", "</env>"),
        re.compile(
            r"^(?P<block>(?:[^\n<]*:[ \t]*\r?\n)?<env>[ \t]*\r?\n(?:.*?\n)??</env>[ \t]*"
            r"(?:\r?\n<project>[ \t]*\r?\n(?:.*?\n)??</project>[ \t]*)?)(?:\r?\n|\Z)",
            re.MULTILINE | re.DOTALL,
        ),
    ),
    "cline_system_information": Recogniser(
        ("SYSTEM INFORMATION",),
        re.compile(
            r"^(?:====[ \t]*\r?\n[ \t]*\r?\n)?"
            r"(?P<block>SYSTEM INFORMATION[ \t]*\r?\n(?:[ \t]*\r?\n)?(?:[^\n]*\S[^\n]*(?:\n|\Z))+)"
            r"(?:[ \t]*\r?\n)*",
            re.MULTILINE,
        ),
    ),
}

BLOCK_NAMES: tuple[BlockName, ...] = get_args(BlockName)
assert tuple(RECOGNISERS) == BLOCK_NAMES, "one recogniser per block name"


def extract_env_blocks(text: str, names: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """``text`` without the recognised blocks, and the blocks (outer whitespace stripped), in text order."""
    return extract_blocks(text, [RECOGNISERS[name] for name in names])


class EnvBlockSettings(RuleConfig):
    """Rule 7 (opt-in): recognised environment blocks moved to a user message after the system."""

    enabled: bool = False
    blocks: tuple[BlockName, ...] = BLOCK_NAMES


def _build(settings: EnvBlockSettings) -> TextStep | None:
    if not settings.blocks:
        return None
    recognisers = [RECOGNISERS[name] for name in settings.blocks]

    def run(text: str) -> TextEdit:
        out, blocks = extract_blocks(text, recognisers)
        return TextEdit(out, len(blocks), tuple(Moved(b, Destination.AFTER_SYSTEM) for b in blocks))

    # a block is only recognised where all its needles occur, so where its first one does
    return TextStep(run, markers=tuple(recogniser.needles[0] for recogniser in recognisers))


RULE = TextRule(NAME, EnvBlockSettings, _build)
