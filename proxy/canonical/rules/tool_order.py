"""Rule 1, ``tool_order``: a stable tool order.

Agents send tools in HashMap or discovery order (Codex's MCP tools, Goose's extensions, opencode after
a restart), and MCP servers connect mid-session; every reorder changes the tool block. ``session``
mode keeps the order in which the session first saw each tool and appends new tools at the end (a
tool that disappears keeps its slot, so a reconnect restores the old bytes). ``sort`` mode orders by
name, the same for every session. Names compare by code point: no locale.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from proxy.canonical.rules.base import RuleConfig, SessionToolsRule, SessionToolsStep, ToolList, ToolsEdit
from proxy.canonical.state import SessionCanonState

NAME = "tool_order"


def sorted_positions(names: Sequence[str]) -> list[int]:
    """Positions of ``names`` sorted by name (stable for equal names)."""
    return sorted(range(len(names)), key=names.__getitem__)


def session_positions(
    names: Sequence[str], prior: Sequence[str] | None, max_names: int
) -> tuple[list[int], list[str] | None]:
    """Positions of ``names`` in first-seen order, and the new order to store (None when unchanged).

    ``prior`` is the session's first-seen order so far. Tools not in it go last in request order and
    are appended to the stored order while it holds fewer than ``max_names`` names.
    """
    rank = {name: i for i, name in enumerate(prior)} if prior else {}
    known = len(rank)
    added: list[str] = []
    for name in names:
        if name not in rank and known + len(added) < max_names:
            rank[name] = known + len(added)
            added.append(name)
    unranked = len(rank)
    positions = sorted(range(len(names)), key=lambda i: (rank.get(names[i], unranked), i))
    if not added:
        return positions, None
    return positions, [*(prior or ()), *added]


class ToolOrderSettings(RuleConfig):
    """Rule 1: ``session`` = first-seen order per session; ``sort`` = by name, shared by all sessions."""

    mode: Literal["session", "sort"] = "session"
    # Without session state ``session`` mode cannot remember anything: sort, or keep the client's order.
    sessionless: Literal["sort", "keep"] = "sort"
    max_names: int = Field(default=1024, ge=1)


def _build(settings: ToolOrderSettings) -> SessionToolsStep:
    mode, sessionless, max_names = settings.mode, settings.sessionless, settings.max_names

    def step(view: ToolList, session: SessionCanonState | None) -> ToolsEdit:
        names = view.all_named()
        if names is None or len(names) < 2:  # a tool without a function name: order left alone
            return ToolsEdit(view)
        effective = mode if mode == "sort" or session is not None else sessionless
        if effective == "sort":
            positions = sorted_positions(names)
        elif effective == "session" and session is not None:
            positions, stored = session_positions(names, session.get_tool_order(), max_names)
            if stored is not None:
                session.set_tool_order(stored)
        else:
            return ToolsEdit(view)
        moved = sum(1 for i, p in enumerate(positions) if i != p)
        return ToolsEdit(view.select(positions), moved) if moved else ToolsEdit(view)

    return step


RULE = SessionToolsRule(NAME, ToolOrderSettings, _build)
