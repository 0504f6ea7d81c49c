"""Per-session canonicalization state, behind a tiny protocol so it can live in Redis.

Three things are remembered per session, all plain JSON:

- the first-seen tool order (``tool_order`` rule, ``session`` mode): a list of function names;
- the parameter order of each tool (``param_order``): per tool signature (a string naming the tool
  and its parameter names), the order of the names in each of its name lists, a list of lists
  (the in-memory state keeps the tuples the rule gives it);
- where text pinned to a user message was attached (``Destination.NEWEST_USER``: the moved date
  lines of ``volatile_date`` ``move`` mode): a list of ``[message_index, line]`` pairs, indices into
  the *canonical* message list. Re-attaching a line to the same message every turn keeps the history
  byte-stable; a new date goes to the newest user message and the old attachment stays where it was.

Getters return None when nothing is stored. Setters are only called when the value changes, so a
store can write through without batching.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class SessionCanonState(Protocol):
    """Session-scoped state the canonicalizer reads and writes."""

    def get_tool_order(self) -> list[str] | None:
        """Function names in the order the session first saw them, or None."""
        ...

    def set_tool_order(self, names: list[str]) -> None:
        """Store the first-seen order (the previous list plus appended names)."""
        ...

    def get_param_order(self, signature: str) -> Sequence[Sequence[str]] | None:
        """The parameter order the session gave the tool of ``signature``, or None."""
        ...

    def set_param_order(self, signature: str, order: Sequence[Sequence[str]]) -> None:
        """Store the parameter order of the tool of ``signature`` (set once per signature)."""
        ...

    def count_param_orders(self) -> int:
        """How many tool signatures the session holds an order for (the rule bounds it)."""
        ...

    def get_date_anchors(self) -> list[tuple[int, str]] | None:
        """``(message_index, line)`` attachments of moved date lines, oldest first, or None."""
        ...

    def set_date_anchors(self, anchors: list[tuple[int, str]]) -> None:
        """Store the attachments."""
        ...


class InMemorySessionCanonState:
    """``SessionCanonState`` held in the object itself (one per session, one process)."""

    __slots__ = ("date_anchors", "param_orders", "tool_order")

    def __init__(self) -> None:
        self.tool_order: list[str] | None = None
        self.param_orders: dict[str, Sequence[Sequence[str]]] | None = None
        self.date_anchors: list[tuple[int, str]] | None = None

    def get_tool_order(self) -> list[str] | None:
        """See ``SessionCanonState``."""
        return self.tool_order

    def set_tool_order(self, names: list[str]) -> None:
        """See ``SessionCanonState``."""
        self.tool_order = list(names)

    def get_param_order(self, signature: str) -> Sequence[Sequence[str]] | None:
        """See ``SessionCanonState``."""
        return self.param_orders.get(signature) if self.param_orders else None

    def set_param_order(self, signature: str, order: Sequence[Sequence[str]]) -> None:
        """See ``SessionCanonState`` (kept as given: the rule passes tuples, never changed after)."""
        if self.param_orders is None:
            self.param_orders = {}
        self.param_orders[signature] = order

    def count_param_orders(self) -> int:
        """See ``SessionCanonState``."""
        return len(self.param_orders) if self.param_orders else 0

    def get_date_anchors(self) -> list[tuple[int, str]] | None:
        """See ``SessionCanonState``."""
        return self.date_anchors

    def set_date_anchors(self, anchors: list[tuple[int, str]]) -> None:
        """See ``SessionCanonState``."""
        self.date_anchors = [(int(i), str(line)) for i, line in anchors]
