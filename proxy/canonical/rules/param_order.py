"""Rule ``param_order``: one order of parameter names per tool, shared by the sessions of an agent.

MCP servers, re-serializing gateways and agents that build schemas from hash maps send a tool's
parameter names (the keys inside ``properties``) and its ``required`` list in an order of their own
per session, so sessions of one agent stop sharing system + tools. ``schema_key_order`` orders the
schema keywords and leaves the names alone; this rule gives each name list of a tool's schema (the
name -> schema maps such as ``properties``, and ``required``, at any depth) one order per session,
never changed afterwards. Where a new session's order comes from (``new_session``):

- ``shared`` (the default): the order this process first saw for that tool (any session), so every
  later session with the same tool, in whatever order, gets the same bytes;
- ``sort``: by name (code point), the same in every replica and after a restart;
- ``own``: the order the session first sent it in.

A tool is known by its name and the set of its name lists (where each sits, and its names): a
changed schema (a parameter added) is another tool, with an order of its own. Only the order of JSON
object keys and of ``required`` changes, nothing else: the model reads the same parameters in
another order, and tool-call arguments (JSON objects, by name) keep their meaning. Without session
state the ``new_session`` order applies without being remembered.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import orjson
import xxhash
from pydantic import Field

from proxy.canonical.rules.base import RuleConfig, SessionToolsRule, SessionToolsStep, ToolList, ToolsEdit
from proxy.canonical.rules.schema_keys import SCHEMA_LISTS, SCHEMA_MAPS, SCHEMA_ONE
from proxy.canonical.state import SessionCanonState
from tokenization.lru import LRU

NAME = "param_order"

#: Where a name list sits in a tool's ``parameters``: keywords, parameter names and list indices.
SchemaPath: TypeAlias = tuple[str | int, ...]
#: The names of each of a tool's name lists, in the order of its layout's paths.
Order: TypeAlias = tuple[tuple[str, ...], ...]
#: Distinct tools whose layout (and reordered form) this process keeps.
_CACHED_TOOLS = 4096
#: Distinct tool lists whose layouts this process keeps, and the outcomes kept per list.
_CACHED_LISTS = 1024
_OUTCOMES_PER_LIST = 16


def name_lists(schema: Any, path: SchemaPath = ()) -> Iterator[tuple[SchemaPath, tuple[str, ...]]]:
    """Every name list of ``schema`` with two names or more: name -> schema maps (their keys) and
    ``required`` lists of distinct strings, with where each sits; subschemas as ``canonical_schema``
    walks them."""
    if not isinstance(schema, dict):
        return
    for key, value in schema.items():
        here = (*path, key)
        if key in SCHEMA_MAPS and isinstance(value, dict):
            if len(value) > 1:
                yield here, tuple(value)
            for name, sub in value.items():
                yield from name_lists(sub, (*here, name))
        elif key == "required" and isinstance(value, list):
            if len(value) > 1 and all(isinstance(n, str) for n in value) and len(set(value)) == len(value):
                yield here, tuple(value)
        elif key in SCHEMA_LISTS and isinstance(value, list):
            for index, sub in enumerate(value):
                yield from name_lists(sub, (*here, index))
        elif key in SCHEMA_ONE:
            yield from name_lists(value, here)


def reordered(schema: Any, orders: dict[SchemaPath, tuple[str, ...]], path: SchemaPath = ()) -> Any:
    """``schema`` with the name lists at ``orders``' paths in those orders; everything else as is."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        here = (*path, key)
        if key in SCHEMA_MAPS and isinstance(value, dict):
            names = orders.get(here, tuple(value))
            value = {name: reordered(value[name], orders, (*here, name)) for name in names}
        elif key == "required" and here in orders:
            value = list(orders[here])
        elif key in SCHEMA_LISTS and isinstance(value, list):
            value = [reordered(sub, orders, (*here, index)) for index, sub in enumerate(value)]
        elif key in SCHEMA_ONE:
            value = reordered(value, orders, here)
        out[key] = value
    return out


@dataclass(frozen=True, slots=True)
class Layout:
    """A tool's name lists: ``signature`` names the tool and the set of them (None: nothing to order),
    ``paths`` where they sit (sorted, so the same for any order of the names) and ``sent`` the order
    this copy of the tool has them in."""

    signature: str | None
    paths: tuple[SchemaPath, ...] = ()
    sent: Order = ()


def layout_of(name: str, tool: Any) -> Layout:
    """The layout of ``tool`` (an OpenAI tool envelope named ``name``)."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    params = fn.get("parameters") if isinstance(fn, dict) else None
    found = sorted(name_lists(params), key=lambda entry: orjson.dumps(entry[0]))
    if not found:
        return Layout(None)
    shape = [name, [[list(path), sorted(names)] for path, names in found]]
    signature = xxhash.xxh3_128_hexdigest(orjson.dumps(shape))
    return Layout(signature, tuple(path for path, _ in found), tuple(names for _, names in found))


def with_order(tool: dict[str, Any], layout: Layout, order: Order) -> dict[str, Any]:
    """``tool`` with its name lists in ``order`` (aligned with ``layout.paths``)."""
    fn = tool["function"]
    params = reordered(fn["parameters"], dict(zip(layout.paths, order, strict=True)))
    return {**tool, "function": {**fn, "parameters": params}}


@dataclass(slots=True)
class _ListLayouts:
    """One tool list's layouts (per tool its digest and layout, None: nothing to order) and the
    outcomes already computed for it, keyed by the identities of the orders applied (the orders are
    long-lived objects: the shared table's and the sessions' own) and checked against them."""

    entries: tuple[tuple[bytes, Layout] | None, ...]
    outcomes: dict[tuple[int, ...], tuple[tuple[Order | None, ...], ToolsEdit]]


class ParamOrderSettings(RuleConfig):
    """``param_order``: one parameter order per tool and session; a new session's from ``new_session``."""

    #: A new session's order of a tool's parameter names: the order this process first saw for that
    #: tool (``shared``), by name (``sort``), or as the session sent it (``own``).
    new_session: Literal["shared", "sort", "own"] = "shared"
    #: Tools whose order one session remembers (past it, a tool gets the ``new_session`` order).
    max_tools: int = Field(default=1024, ge=1)
    #: Tools whose first order (``shared``: first seen; ``sort``: sorted) this process remembers.
    shared_tools: int = Field(default=4096, ge=1)


class _Orders:
    """The compiled rule: its settings, the shared first-seen orders and the per-tool caches."""

    def __init__(self, settings: ParamOrderSettings) -> None:
        self.new_session = settings.new_session
        self.max_tools = settings.max_tools
        self.shared: LRU[str, Order] = LRU(settings.shared_tools)
        self.layouts: LRU[bytes, Layout] = LRU(_CACHED_TOOLS)
        self.rebuilt: LRU[tuple[bytes, Order], tuple[dict[str, Any], bytes]] = LRU(_CACHED_TOOLS)
        self.lists: LRU[bytes, _ListLayouts] = LRU(_CACHED_LISTS)

    def first_order(self, layout: Layout) -> Order:
        """The order a session seeing this tool for the first time starts from (one object per tool
        while the table holds it: outcomes are cached by the identity of the orders)."""
        if self.new_session == "own" or layout.signature is None:
            return layout.sent
        found = self.shared.get(layout.signature)
        if found is None:
            found = layout.sent
            if self.new_session == "sort":
                found = tuple(tuple(sorted(names)) for names in layout.sent)
            self.shared.put(layout.signature, found)
        return found

    def order_for(self, layout: Layout, session: SessionCanonState | None) -> Order:
        """The order ``session`` gives this tool: its stored one, else a first one (stored if room)."""
        signature = layout.signature
        if session is None or signature is None:
            return self.first_order(layout)
        stored = session.get_param_order(signature)
        if stored is not None:  # tuples as stored in memory; lists from a store that serializes
            return stored if isinstance(stored, tuple) else tuple(tuple(names) for names in stored)
        order = self.first_order(layout)
        if session.count_param_orders() < self.max_tools:
            session.set_param_order(signature, order)
        return order

    def list_layouts(self, view: ToolList, keys: Sequence[bytes]) -> _ListLayouts:
        """The layouts of ``view``'s tools: one lookup per list (tool serializations are JSON objects,
        so their concatenation names the list)."""
        hasher = xxhash.xxh3_128()
        for key in keys:
            hasher.update(key)
        list_digest = hasher.digest()
        found = self.lists.get(list_digest)
        if found is None:
            entries: list[tuple[bytes, Layout] | None] = []
            for name, tool, key in zip(view.names, view.tools, keys, strict=True):
                digest = xxhash.xxh3_128_digest(key)
                layout = self.layouts.get(digest)
                if layout is None:
                    layout = layout_of(name, tool) if name is not None else Layout(None)
                    self.layouts.put(digest, layout)
                entries.append((digest, layout) if layout.signature is not None else None)
            found = _ListLayouts(tuple(entries), {})
            self.lists.put(list_digest, found)
        return found

    def __call__(self, view: ToolList, session: SessionCanonState | None) -> ToolsEdit:
        keys = view.keys if view.keys is not None else tuple(orjson.dumps(t) for t in view.tools)
        layouts = self.list_layouts(view, keys)
        orders = tuple(
            None if entry is None else self.order_for(entry[1], session) for entry in layouts.entries
        )
        ids = tuple(map(id, orders))
        known = layouts.outcomes.get(ids)
        if known is not None and all(a is b for a, b in zip(known[0], orders, strict=True)):
            return known[1] if known[1].count else ToolsEdit(view)
        edit = self.reordered(view, keys, layouts, orders)
        if len(layouts.outcomes) >= _OUTCOMES_PER_LIST:
            layouts.outcomes.clear()
        layouts.outcomes[ids] = (orders, edit)
        return edit

    def reordered(
        self,
        view: ToolList,
        keys: Sequence[bytes],
        layouts: _ListLayouts,
        orders: tuple[Order | None, ...],
    ) -> ToolsEdit:
        """``view`` with each tool's name lists in ``orders``."""
        tools, new_keys, moved = list(view.tools), list(keys), 0
        for i, entry in enumerate(layouts.entries):
            order = orders[i]
            if entry is None or order is None or order == entry[1].sent:
                continue
            digest, layout = entry
            hit = self.rebuilt.get((digest, order))
            if hit is None:
                rebuilt = with_order(view.tools[i], layout, order)
                hit = (rebuilt, orjson.dumps(rebuilt))
                self.rebuilt.put((digest, order), hit)
            tools[i], new_keys[i] = hit
            moved += 1
        if not moved:
            return ToolsEdit(view)
        return ToolsEdit(ToolList(tuple(tools), view.names, tuple(new_keys)), moved)


def _build(settings: ParamOrderSettings) -> SessionToolsStep:
    return _Orders(settings)


RULE = SessionToolsRule(NAME, ParamOrderSettings, _build)
