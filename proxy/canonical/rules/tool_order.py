"""Rule 1, ``tool_order``: a stable tool order.

Agents send tools in HashMap or discovery order (Codex's MCP tools, Goose's extensions, opencode after
a restart), and MCP servers connect mid-session; every reorder changes the tool block. ``session``
mode keeps the order in which the session first saw each tool and appends new tools at the end (a
tool that disappears keeps its slot, so a reconnect restores the old bytes). ``sort`` mode orders by
name, the same for every session. Names compare by code point: no locale.

Where a new session's order comes from (``new_session``, ``session`` mode): each session discovering
its tools in its own order would keep that order for good, and sessions of one agent would stop
sharing the tool block. ``shared`` (the default) gives a new session the canonical order of its tool
set: the order in which this process first saw that set (any session), so every later session with
the same tools, in whatever order, gets the same bytes; ``sort`` gives it the tools sorted by name
(the same in every replica and after a restart); ``own`` keeps its own first-seen order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import xxhash
from pydantic import Field

from proxy.canonical.rules.base import RuleConfig, SessionToolsRule, SessionToolsStep, ToolList, ToolsEdit
from proxy.canonical.state import SessionCanonState
from tokenization.lru import LRU

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


class CanonicalOrders:
    """The canonical order of each tool set this process has seen: the order it was first seen in.

    Keyed by a digest of the set's sorted names; bounded (least recently used set out first)."""

    def __init__(self, max_sets: int) -> None:
        self._orders: LRU[bytes, tuple[str, ...]] = LRU(max_sets)

    def order_of(self, names: Sequence[str]) -> tuple[str, ...]:
        """The canonical order of ``names``' set, which becomes ``names`` when the set is new."""
        key = xxhash.xxh3_128_digest("\0".join(sorted(names)).encode("utf-8", "surrogatepass"))
        found = self._orders.get(key)
        if found is None or len(found) != len(names):
            found = tuple(names)
            self._orders.put(key, found)
        return found


class ToolOrderSettings(RuleConfig):
    """Rule 1: ``session`` = first-seen order per session; ``sort`` = by name, shared by all sessions."""

    mode: Literal["session", "sort"] = "session"
    #: ``session`` mode: a new session's order: its tool set's canonical order in this process
    #: (``shared``), by name (``sort``), or its own first-seen order (``own``).
    new_session: Literal["shared", "sort", "own"] = "shared"
    # Without session state ``session`` mode cannot remember anything: sort, or keep the client's order.
    sessionless: Literal["sort", "keep"] = "sort"
    max_names: int = Field(default=1024, ge=1)
    #: ``shared``: tool sets whose canonical order is remembered.
    shared_sets: int = Field(default=4096, ge=1)


def new_session_order(names: Sequence[str], how: str, orders: CanonicalOrders) -> Sequence[str]:
    """The order a session seeing ``names`` first starts from (``ToolOrderSettings.new_session``)."""
    if how == "sort" or (how == "shared" and len(set(names)) != len(names)):
        return [names[i] for i in sorted_positions(names)]
    if how == "shared":
        return orders.order_of(names)
    return names


def _build(settings: ToolOrderSettings) -> SessionToolsStep:
    mode, sessionless, max_names = settings.mode, settings.sessionless, settings.max_names
    new_session, orders = settings.new_session, CanonicalOrders(settings.shared_sets)

    def step(view: ToolList, session: SessionCanonState | None) -> ToolsEdit:
        names = view.all_named()
        if names is None or len(names) < 2:  # a tool without a function name: order left alone
            return ToolsEdit(view)
        effective = mode if mode == "sort" or session is not None else sessionless
        if effective == "sort":
            positions = sorted_positions(names)
        elif effective == "session" and session is not None:
            prior = session.get_tool_order()
            if prior is None and len(names) <= max_names:
                prior = list(new_session_order(names, new_session, orders))
                session.set_tool_order(prior)
            positions, stored = session_positions(names, prior, max_names)
            if stored is not None:
                session.set_tool_order(stored)
        else:
            return ToolsEdit(view)
        moved = sum(1 for i, p in enumerate(positions) if i != p)
        return ToolsEdit(view.select(positions), moved) if moved else ToolsEdit(view)

    return step


RULE = SessionToolsRule(NAME, ToolOrderSettings, _build)
