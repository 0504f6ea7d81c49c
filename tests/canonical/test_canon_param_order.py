"""The ``param_order`` rule: one order of parameter names per tool and session, shared by new sessions."""

from __future__ import annotations

import random
from typing import Any

import orjson

from proxy.canonical import CanonicalConfig, Canonicalizer, InMemorySessionCanonState
from proxy.canonical.rules.param_order import layout_of


def tool(names: list[str], required: list[str], name: str = "edit") -> dict[str, Any]:
    """A tool whose parameters are ``names`` (in that order), ``path`` holding a nested object."""
    props: dict[str, Any] = {}
    for n in names:
        if n == "path":
            props[n] = {
                "type": "object",
                "properties": {"dir": {"type": "string"}, "file": {"type": "string"}},
                "required": ["dir", "file"],
            }
        else:
            props[n] = {"description": f"the {n}", "type": "string"}  # keywords in canonical order
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": "d",
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


def flipped(t: dict[str, Any]) -> dict[str, Any]:
    """``t`` with every name list reversed (nested ones too): another session's serialization."""
    params = t["function"]["parameters"]
    props = {k: params["properties"][k] for k in reversed(params["properties"])}
    if "path" in props:
        inner = props["path"]
        props["path"] = {
            "type": "object",
            "properties": {k: inner["properties"][k] for k in reversed(inner["properties"])},
            "required": list(reversed(inner["required"])),
        }
    new_params = {"type": "object", "properties": props, "required": list(reversed(params["required"]))}
    return {**t, "function": {**t["function"], "parameters": new_params}}


def as_sets(value: Any) -> Any:
    """``value`` with ``required`` lists as sets (dicts compare without their key order already)."""
    if isinstance(value, dict):
        return {k: set(v) if k == "required" else as_sets(v) for k, v in value.items()}
    if isinstance(value, list):
        return [as_sets(v) for v in value]
    return value


def request(*tools: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": "s"}], "tools": list(tools)}


def canon(config: dict[str, Any] | None = None) -> Canonicalizer:
    return Canonicalizer(CanonicalConfig.model_validate(config or {}), strict=True)


def names_of(body: dict[str, Any]) -> list[tuple[list[str], list[str], list[str], list[str]]]:
    """Per tool: parameter names, required, and the nested ``path`` object's names and required."""
    out = []
    for t in body["tools"]:
        params = t["function"]["parameters"]
        inner = params["properties"].get("path", {"properties": {}, "required": []})
        nested = (list(inner["properties"]), inner["required"])
        out.append((list(params["properties"]), params["required"], *nested))
    return out


A = tool(["command", "path", "timeout"], ["command", "path"])
A_NAMES = (["command", "path", "timeout"], ["command", "path"], ["dir", "file"], ["dir", "file"])


def test_a_new_session_gets_the_order_the_process_first_saw() -> None:
    c = canon()
    first = c.apply(request(A), api="chat", session=InMemorySessionCanonState())
    assert not first.changed  # the first session's order is the shared one
    second = c.apply(request(flipped(A)), api="chat", session=InMemorySessionCanonState())
    assert second.changed and second.rewrites == {"param_order": 1}
    assert orjson.dumps(second.body["tools"]) == orjson.dumps([A])
    # the same definitions: only the order of keys and of ``required`` changed
    assert as_sets(second.body["tools"][0]) == as_sets(flipped(A))
    assert orjson.dumps(second.body["tools"][0]) != orjson.dumps(flipped(A))


def test_a_session_keeps_its_order_across_turns() -> None:
    c = canon({"rules": {"param_order": {"new_session": "own"}}})
    state = InMemorySessionCanonState()
    turns = [flipped(A), A, flipped(A), A]
    bodies = [c.apply(request(t), api="chat", session=state).body for t in turns]
    assert {orjson.dumps(b["tools"]) for b in bodies} == {orjson.dumps([flipped(A)])}


def test_shared_order_given_once_is_kept_even_if_the_process_forgets_it() -> None:
    c = canon({"rules": {"param_order": {"shared_tools": 1}}})
    c.apply(request(A), api="chat", session=InMemorySessionCanonState())
    state = InMemorySessionCanonState()
    given = c.apply(request(flipped(A)), api="chat", session=state).body
    c.apply(request(tool(["x", "y"], ["x", "y"], "other")), api="chat")  # pushes A's order out
    later = c.apply(request(flipped(A)), api="chat", session=state).body
    assert orjson.dumps(later) == orjson.dumps(given) == orjson.dumps(request(A))


def test_a_changed_schema_gets_its_own_order() -> None:
    c = canon()
    c.apply(request(A), api="chat", session=InMemorySessionCanonState())
    grown = tool(["timeout", "path", "command", "env"], ["path", "command"])
    once = c.apply(request(grown), api="chat", session=InMemorySessionCanonState())
    assert not once.changed  # a new parameter set: first seen here, as sent
    again = c.apply(request(flipped(grown)), api="chat", session=InMemorySessionCanonState())
    assert names_of(again.body)[0][:2] == (["timeout", "path", "command", "env"], ["path", "command"])


def test_sort_and_own() -> None:
    sort = canon({"rules": {"param_order": {"new_session": "sort"}}})
    unsorted = tool(["timeout", "path", "command"], ["path", "command"])
    sort.apply(request(unsorted), api="chat", session=InMemorySessionCanonState())  # not the shared one
    body = sort.apply(request(flipped(unsorted)), api="chat", session=InMemorySessionCanonState()).body
    assert names_of(body) == [A_NAMES]
    own = canon({"rules": {"param_order": {"new_session": "own"}}})
    own.apply(request(A), api="chat", session=InMemorySessionCanonState())
    assert not own.apply(request(flipped(A)), api="chat", session=InMemorySessionCanonState()).changed


def test_nested_lists_and_required_follow_the_shared_order() -> None:
    c = canon()
    c.apply(request(A), api="chat", session=InMemorySessionCanonState())
    body = c.apply(request(flipped(A)), api="chat", session=InMemorySessionCanonState()).body
    assert names_of(body) == [A_NAMES]


def test_without_a_session_the_shared_order_applies() -> None:
    c = canon()
    c.apply(request(A), api="chat")
    assert orjson.dumps(c.apply(request(flipped(A)), api="chat").body) == orjson.dumps(request(A))


def test_per_session_orders_are_bounded() -> None:
    c = canon({"rules": {"param_order": {"max_tools": 2}}})
    state = InMemorySessionCanonState()
    tools = [tool(["a", "b"], [], f"t{i}") for i in range(4)]
    c.apply(request(*tools), api="chat", session=state)
    assert state.count_param_orders() == 2


def test_idempotent_and_same_bytes_for_any_session_order() -> None:
    """Sessions sending their tools' parameters in random orders all end with the first one's bytes."""
    rng = random.Random(7)
    names = ["command", "path", "timeout", "cwd", "env"]
    c = canon()
    outs = set()
    for _ in range(8):
        order = rng.sample(names, len(names))
        req = rng.sample(["command", "path"], 2)
        body = c.apply(request(tool(order, req)), api="chat", session=InMemorySessionCanonState()).body
        again = c.apply(body, api="chat", session=InMemorySessionCanonState()).body
        assert orjson.dumps(again) == orjson.dumps(body)
        outs.add(orjson.dumps(body))
    assert len(outs) == 1


def test_layout_signature_ignores_order_but_not_names() -> None:
    a, b = layout_of("edit", A), layout_of("edit", flipped(A))
    assert a.signature == b.signature and a.paths == b.paths and a.sent != b.sent
    assert layout_of("edit", tool(["command", "path"], ["command"])).signature != a.signature
    assert layout_of("other", A).signature != a.signature
    assert layout_of("none", tool(["only"], [])).signature is None


def test_sessions_with_other_orders_on_one_tool_list_get_their_own() -> None:
    """Outcomes are cached per tool list: sessions giving that list other orders still get theirs."""
    c = canon({"rules": {"param_order": {"new_session": "own"}}})
    a, b = InMemorySessionCanonState(), InMemorySessionCanonState()
    c.apply(request(A), api="chat", session=a)
    c.apply(request(flipped(A)), api="chat", session=b)
    for _ in range(3):
        assert orjson.dumps(c.apply(request(A), api="chat", session=a).body) == orjson.dumps(request(A))
        as_b = c.apply(request(A), api="chat", session=b).body
        assert orjson.dumps(as_b) == orjson.dumps(request(flipped(A)))
        as_a = c.apply(request(flipped(A)), api="chat", session=a).body
        assert orjson.dumps(as_a) == orjson.dumps(request(A))
