"""The canonicalization rules, one module per rule; each is a small pure function over text or tools.

Order of application (``RULE_ORDER``): the system-text rules, per text, then the tool rules.
``whitespace`` runs last among the text rules so that what the others cut out leaves no ragged edges.
"""

from __future__ import annotations

from proxy.canonical.rules import (
    attribution,
    dedupe_tools,
    env_block,
    schema_keys,
    tool_order,
    volatile_date,
    whitespace,
)

TEXT_RULES: tuple[str, ...] = (attribution.NAME, volatile_date.NAME, env_block.NAME, whitespace.NAME)
TOOL_RULES: tuple[str, ...] = (schema_keys.NAME, dedupe_tools.NAME, tool_order.NAME)
RULE_ORDER: tuple[str, ...] = TEXT_RULES + TOOL_RULES

__all__ = ["RULE_ORDER", "TEXT_RULES", "TOOL_RULES"]
