"""Unit tests of the tool rules: schema_key_order (2), dedupe_tools (3), tool_order (1)."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.canonical import CanonicalConfig, Canonicalizer, InMemorySessionCanonState
from proxy.canonical.rules.dedupe_tools import drop_duplicate_tools
from proxy.canonical.rules.schema_keys import canonical_schema, canonical_tool
from proxy.canonical.rules.tool_order import session_positions, sorted_positions


def test_envelope_and_function_key_order() -> None:
    wire = {
        "type": "function",
        "name": "shell",
        "function": {"parameters": {"type": "object"}, "strict": False, "name": "shell", "description": "d"},
    }
    out = canonical_tool(wire)
    assert list(out) == ["type", "function", "name"]
    assert list(out["function"]) == ["name", "description", "parameters", "strict"]
    assert out == wire  # same content, only the order differs


def test_schema_keywords_ordered_but_property_names_and_required_kept() -> None:
    schema = {
        "required": ["z", "a"],
        "additionalProperties": False,
        "$schema": "http://json-schema.org/draft-07/schema#",
        "properties": {
            "z": {"description": "last letter", "type": "string", "enum": ["b", "a"]},
            "a": {"items": {"type": "string", "minLength": 1}, "type": "array"},
        },
        "type": "object",
        "x-vendor": {"b": 1, "a": 2},
    }
    out = canonical_schema(schema)
    assert list(out) == ["$schema", "type", "properties", "required", "additionalProperties", "x-vendor"]
    assert list(out["properties"]) == ["z", "a"]
    assert out["required"] == ["z", "a"]
    assert list(out["properties"]["z"]) == ["description", "type", "enum"]
    assert out["properties"]["z"]["enum"] == ["b", "a"]
    assert list(out["properties"]["a"]) == ["type", "items"]
    assert list(out["x-vendor"]) == ["b", "a"]  # unknown keyword: value untouched
    assert canonical_schema(out) == out
    assert orjson.dumps(canonical_schema(out)) == orjson.dumps(out)


def test_subschemas_in_lists_and_maps() -> None:
    schema = {"anyOf": [{"type": "string", "description": "s"}], "$defs": {"B": {"type": "x", "title": "t"}}}
    out = canonical_schema(schema)
    assert list(out["anyOf"][0]) == ["description", "type"]
    assert list(out["$defs"]["B"]) == ["title", "type"]


def test_non_dict_tools_pass_through() -> None:
    for odd in (None, 3, "tool", ["a"], {"function": "x"}):
        assert canonical_tool(odd) == odd


def test_drop_duplicates_and_name_conflicts() -> None:
    tools = ["A", "B", "A2", "A"]
    keys = [b"a", b"b", b"a2", b"a"]
    names = ["a", "b", "a", "a"]
    assert drop_duplicate_tools(tools, keys, names, "keep_all") == ([0, 1, 2], 1)
    assert drop_duplicate_tools(tools, keys, names, "keep_first") == ([0, 1], 2)
    assert drop_duplicate_tools(tools, keys, [None] * 4, "keep_first") == ([0, 1, 2], 1)


def test_sort_mode_orders_by_code_point() -> None:
    names = ["b", "B", "a", "_x", "a"]
    assert [names[i] for i in sorted_positions(names)] == ["B", "_x", "a", "a", "b"]


def test_session_mode_first_seen_new_appended() -> None:
    positions, stored = session_positions(["c", "a", "b"], None, 100)
    assert positions == [0, 1, 2] and stored == ["c", "a", "b"]
    names = ["b", "x", "c", "a"]
    positions, stored = session_positions(names, ["c", "a", "b"], 100)
    assert [names[i] for i in positions] == ["c", "a", "b", "x"]
    assert stored == ["c", "a", "b", "x"]
    positions, stored = session_positions(["a", "c"], ["c", "a", "b", "x"], 100)
    assert positions == [1, 0] and stored is None  # removed tools keep their slot


def test_session_mode_bounded_memory() -> None:
    names = ["d", "c", "b", "a"]
    positions, stored = session_positions(names, ["a"], 2)
    assert stored == ["a", "d"]
    assert [names[i] for i in positions] == ["a", "d", "c", "b"]  # beyond the bound: request order


def test_new_sessions_share_their_tool_sets_canonical_order() -> None:
    """Sessions discovering the same tools in their own orders all get the first one's order, so they
    share the tool block; each then keeps it and appends new tools (``new_session: shared``)."""
    config = CanonicalConfig.model_validate({})
    canonicalizer = Canonicalizer(config, strict=True)
    names = lambda r: [t["function"]["name"] for t in r.body["tools"]]  # noqa: E731

    def request(*tools: str) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": "u"}], "tools": [_tool(n) for n in tools]}

    first, second = InMemorySessionCanonState(), InMemorySessionCanonState()
    assert not canonicalizer.apply(request("c", "a", "b"), api="chat", session=first).changed
    other = canonicalizer.apply(request("b", "c", "a"), api="chat", session=second)
    assert names(other) == ["c", "a", "b"]
    grown = canonicalizer.apply(request("d", "a", "b", "c"), api="chat", session=second)
    assert names(grown) == ["c", "a", "b", "d"]
    by_name = Canonicalizer(
        CanonicalConfig.model_validate({"rules": {"tool_order": {"new_session": "sort"}}}), strict=True
    )
    assert names(by_name.apply(request("c", "a", "b"), api="chat", session=InMemorySessionCanonState())) == [
        "a",
        "b",
        "c",
    ]
    own = Canonicalizer(
        CanonicalConfig.model_validate({"rules": {"tool_order": {"new_session": "own"}}}), strict=True
    )
    own.apply(request("c", "a", "b"), api="chat", session=InMemorySessionCanonState())
    assert not own.apply(request("b", "c", "a"), api="chat", session=InMemorySessionCanonState()).changed


def _tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
