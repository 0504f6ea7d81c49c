"""Rule 3, ``dedupe_tools``: drop exact-duplicate tools.

An MCP server registered twice, or re-announced after a reconnect, sends the same tool twice; the
second copy is noise for the model and a drift for the cache. Two tools are duplicates when their
canonical forms (``schema_key_order``) serialize to the same bytes. The same name with a different
definition is a conflict: ``keep_all`` passes both through, ``keep_first`` drops the later ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Literal

from proxy.canonical.rules.base import RuleConfig, ToolList, ToolsEdit, ToolsRule, ToolsStep
from proxy.canonical.rules.schema_keys import canonical_keys

NAME = "dedupe_tools"

OnNameConflict = Literal["keep_all", "keep_first"]


def drop_duplicate_tools(
    tools: Sequence[Any],
    keys: Sequence[bytes],
    names: Sequence[str | None],
    on_name_conflict: OnNameConflict = "keep_all",
) -> tuple[list[int], int]:
    """Indices of the tools to keep (in order) and how many were dropped.

    ``keys[i]`` is the canonical serialization of ``tools[i]`` and ``names[i]`` its function name
    (None when it has none; such tools are only deduplicated by bytes).
    """
    seen_keys: set[bytes] = set()
    seen_names: set[str] = set()
    keep: list[int] = []
    for i in range(len(tools)):
        key, name = keys[i], names[i]
        if key in seen_keys:
            continue
        if on_name_conflict == "keep_first" and name is not None and name in seen_names:
            continue
        seen_keys.add(key)
        if name is not None:
            seen_names.add(name)
        keep.append(i)
    return keep, len(tools) - len(keep)


class DedupeToolsSettings(RuleConfig):
    """Rule 3: drop exact duplicates; same name with another definition: keep all or keep the first."""

    on_name_conflict: OnNameConflict = "keep_all"


def _build(settings: DedupeToolsSettings) -> ToolsStep:
    on_name_conflict = settings.on_name_conflict

    def step(view: ToolList) -> ToolsEdit:
        keys = view.keys if view.keys is not None else canonical_keys(view.tools)
        keep, dropped = drop_duplicate_tools(view.tools, keys, view.names, on_name_conflict)
        view = replace(view, keys=keys)
        return ToolsEdit(view.select(keep), dropped) if dropped else ToolsEdit(view)

    return step


RULE = ToolsRule(NAME, DedupeToolsSettings, _build)
