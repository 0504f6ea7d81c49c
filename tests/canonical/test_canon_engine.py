"""The engine: API contract, pass-through, configuration overrides, session state and caching."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from proxy.canonical import (
    CanonicalConfig,
    Canonicalizer,
    InMemorySessionCanonState,
    SessionCanonState,
    first_differing_line,
    first_differing_part,
    split_parts,
)

BILLING = "x-anthropic-billing-header: cc_version=2.1.30.4c1; cc_entrypoint=cli; cch=5d21e;"


def tool(name: str, **params: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": params or {}}}


def body(system: Any, *users: str, tools: list[Any] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"model": "m", "messages": [{"role": "system", "content": system}]}
    out["messages"] += [{"role": "user", "content": u} for u in users]
    if tools is not None:
        out["tools"] = tools
    return out


def canon(config: dict[str, Any] | None = None) -> Canonicalizer:
    return Canonicalizer(CanonicalConfig.model_validate(config or {}), strict=True)


def test_default_keeps_the_final_newline_as_sent() -> None:
    b = body("You help.  \nNo final newline", "hi")
    result = canon().apply(b, api="chat")
    assert result.body["messages"][0]["content"] == "You help.\nNo final newline"
    assert result.rewrites == {"whitespace": 1}


def test_unchanged_body_is_the_same_object() -> None:
    b = body("Plain prompt.\n", "hi", tools=[tool("a"), tool("b")])
    result = canon().apply(b, api="chat")
    assert result.body is b and not result.changed and result.rewrites == {}


def test_rewrites_are_counted_per_rule_and_input_is_not_mutated() -> None:
    b = body(f"{BILLING}\nYou help.  \nThe current date is 2025-08-28 14:03:27.", "hi")
    before = orjson.dumps(b)
    result = canon({"rules": {"whitespace": {"final_newline": "one"}}}).apply(b, api="chat")
    assert result.changed
    assert result.body["messages"][0]["content"] == "You help.\nThe current date is 2025-08-28.\n"
    assert result.rewrites == {"attribution_line": 1, "volatile_date": 1, "whitespace": 1}
    assert orjson.dumps(b) == before
    assert result.body["messages"][1] is b["messages"][1]  # history objects are reused, not copied


@pytest.mark.parametrize(
    "odd",
    [
        {},
        {"messages": None},
        {"messages": "x", "tools": "y"},
        {"messages": [None, 1, "s", [], {"role": "system"}, {"role": "system", "content": 5}]},
        {
            "messages": [
                {"role": "system", "content": [None, {"type": "text", "text": 3}, {"type": "image_url"}]}
            ]
        },
        {"tools": [None, 1, {"function": None}, {"function": {"name": 5}}, {"type": "function"}]},
        {
            "tools": [{"function": {"name": "a", "parameters": {"properties": [1], "items": 3}}}],
            "messages": [],
        },
        {"tools": [{"n": 2**70}]},
    ],
)
def test_odd_shapes_never_raise(odd: dict[str, Any]) -> None:
    result = canon().apply(odd, api="chat", session=InMemorySessionCanonState())
    again = canon().apply(result.body, api="chat")
    assert again.body == result.body  # idempotent on odd shapes too (== : one case is not orjson-able)
    assert again.changed is False


def test_completions_and_non_dict_pass_through() -> None:
    c = canon()
    b = {"prompt": f"{BILLING}\nhi", "model": "m"}
    assert c.apply(b, api="completions").body is b
    for value in (None, [], "s", 3):
        assert c.apply(value, api="chat").body is value


def test_disabled_globally_per_model_and_per_client() -> None:
    b = body(f"{BILLING}\nYou help.\n", "hi")
    assert not canon({"enabled": False}).apply(b, api="chat").changed
    c = canon({"models": {"raw-*": {"enabled": False}}, "clients": {"legacy": {"enabled": False}}})
    assert not c.apply(b, api="chat", model="raw-7b").changed
    assert c.apply(b, api="chat", model="qwen").changed
    assert not c.apply(b, api="chat", model="qwen", client_label="legacy").changed


def test_override_modes_per_model() -> None:
    c = canon({"models": {"qwen3-coder": {"rules": {"volatile_date": {"mode": "move"}}}}})
    b = body("Rules.\nThe current date is 2025-08-28 14:03:27.\n", "hi")
    day = c.apply(b, api="chat", model="other").body
    move = c.apply(b, api="chat", model="qwen3-coder").body
    assert day["messages"][0]["content"] == "Rules.\nThe current date is 2025-08-28.\n"
    assert move["messages"][0]["content"] == "Rules.\n"
    assert move["messages"][1]["content"] == "hi\n\nThe current date is 2025-08-28 14:03:27."


def test_rule_switches() -> None:
    b = body("a  \n", "hi", tools=[tool("b"), tool("a")])
    off = canon({"rules": {"whitespace": {"enabled": False}, "tool_order": {"enabled": False}}})
    assert off.apply(b, api="chat").body is b


def test_list_content_system_drops_emptied_billing_part() -> None:
    system = [
        {"type": "text", "text": BILLING},
        {"type": "text", "text": "You help.\n", "cache_control": {"type": "ephemeral"}},
    ]
    result = canon().apply(body(system, "hi"), api="chat")
    assert result.body["messages"][0]["content"] == [
        {"type": "text", "text": "You help.\n", "cache_control": {"type": "ephemeral"}}
    ]


def test_system_message_emptied_is_dropped() -> None:
    b = {
        "messages": [
            {"role": "system", "content": BILLING},
            {"role": "system", "content": "You help.\n"},
            {"role": "user", "content": "hi"},
        ]
    }
    out = canon().apply(b, api="chat").body
    assert [m["content"] for m in out["messages"]] == ["You help.\n", "hi"]


def test_tool_order_session_mode_first_seen_and_sort_fallback() -> None:
    c = canon()
    state = InMemorySessionCanonState()
    assert isinstance(state, SessionCanonState)
    names = lambda r: [t["function"]["name"] for t in r.body["tools"]]  # noqa: E731
    first = c.apply(body("s\n", "u", tools=[tool("c"), tool("a")]), api="chat", session=state)
    assert not first.changed and state.get_tool_order() == ["c", "a"]
    second = c.apply(body("s\n", "u", tools=[tool("a"), tool("b"), tool("c")]), api="chat", session=state)
    assert names(second) == ["c", "a", "b"] and second.rewrites == {"tool_order": 3}
    assert state.get_tool_order() == ["c", "a", "b"]
    sessionless = c.apply(body("s\n", "u", tools=[tool("c"), tool("a")]), api="chat")
    assert names(sessionless) == ["a", "c"]
    keep = canon({"rules": {"tool_order": {"sessionless": "keep"}}})
    assert not keep.apply(body("s\n", "u", tools=[tool("c"), tool("a")]), api="chat").changed


def test_tools_key_order_and_duplicates() -> None:
    wire = {
        "function": {"parameters": {"properties": {"x": {"type": "string"}}, "type": "object"}, "name": "t"},
        "type": "function",
    }
    result = canon({"rules": {"tool_order": {"mode": "sort"}}}).apply(
        body("s\n", "u", tools=[wire, dict(wire)]), api="chat"
    )
    assert result.rewrites == {"schema_key_order": 2, "dedupe_tools": 1}
    assert orjson.dumps(result.body["tools"]) == (
        b'[{"type":"function","function":{"name":"t","parameters":{"type":"object","properties":{"x":{"type":"string"}}}}}]'
    )


def test_move_mode_pins_the_date_to_its_first_message_across_turns() -> None:
    c = canon({"rules": {"volatile_date": {"mode": "move"}}})
    state = InMemorySessionCanonState()
    sys1 = "Rules.\nToday's date: Mon Nov 03 2025\n"
    t1 = {"messages": [{"role": "system", "content": sys1}, {"role": "user", "content": "q1"}]}
    r1 = c.apply(t1, api="chat", session=state).body
    assert r1["messages"] == [
        {"role": "system", "content": "Rules.\n"},
        {"role": "user", "content": "q1\n\nToday's date: Mon Nov 03 2025"},
    ]
    # Next human turn, same day: the line stays on q1, q2 is untouched: turn 1 is a prefix of turn 2.
    t2 = {
        "messages": [
            *t1["messages"],
            {"role": "assistant", "content": "a1"},
            {"role": "user", "content": "q2"},
        ]
    }
    r2 = c.apply(t2, api="chat", session=state).body
    assert r2["messages"][:2] == r1["messages"] and r2["messages"][3] == {"role": "user", "content": "q2"}
    # Past midnight: the new date goes to the newest user message, the old one stays where it was.
    sys3 = "Rules.\nToday's date: Tue Nov 04 2025\n"
    t3 = {
        "messages": [
            {"role": "system", "content": sys3},
            *t2["messages"][1:],
            {"role": "assistant", "content": "a2"},
            {"role": "user", "content": [{"type": "text", "text": "q3"}]},
        ]
    }
    r3 = c.apply(t3, api="chat", session=state).body
    assert r3["messages"][:4] == r2["messages"]
    assert r3["messages"][5]["content"] == [
        {"type": "text", "text": "q3"},
        {"type": "text", "text": "Today's date: Tue Nov 04 2025"},
    ]
    assert state.get_date_anchors() == [
        (1, "Today's date: Mon Nov 03 2025"),
        (5, "Today's date: Tue Nov 04 2025"),
    ]
    # Idempotent with the same session.
    assert orjson.dumps(c.apply(r3, api="chat", session=state).body) == orjson.dumps(r3)


def test_move_mode_without_user_message_coarsens_in_place() -> None:
    c = canon({"rules": {"volatile_date": {"mode": "move"}}})
    b = {"messages": [{"role": "system", "content": "The current date is 2025-08-28 14:03:27.\n"}]}
    assert c.apply(b, api="chat").body["messages"][0]["content"] == "The current date is 2025-08-28.\n"


def test_env_block_opt_in_inserts_user_message_after_system() -> None:
    system = "Static.\n<env>\nWorking directory: /x\n</env>\n"
    b = body(system, "hi")
    assert canon().apply(b, api="chat").body is b  # off by default
    out = canon({"rules": {"env_block": {"enabled": True}}}).apply(b, api="chat").body
    assert out["messages"] == [
        {"role": "system", "content": "Static.\n"},
        {"role": "user", "content": "<env>\nWorking directory: /x\n</env>"},
        {"role": "user", "content": "hi"},
    ]


def test_cache_hit_gives_equal_bytes_and_rewrites() -> None:
    c = canon()
    b = body(f"{BILLING}\nYou help.", "hi", tools=[tool("b", type="object"), tool("a")])
    r1, r2 = c.apply(b, api="chat"), c.apply(orjson.loads(orjson.dumps(b)), api="chat")
    assert orjson.dumps(r1.body) == orjson.dumps(r2.body) and r1.rewrites == r2.rewrites


def test_split_parts_and_differences() -> None:
    b = {
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        "tools": [tool("t")],
    }
    parts = split_parts(b)
    assert [p.name for p in parts] == ["system[0]", "tool[0]:t", "message[1]"]
    longer = {**b, "messages": [*b["messages"], {"role": "assistant", "content": "a"}]}
    assert first_differing_part(parts, split_parts(longer)) is None
    edited = {**b, "messages": [{"role": "system", "content": "s2"}, *b["messages"][1:]]}
    old, new = first_differing_part(parts, split_parts(edited))  # type: ignore[misc]
    assert old.name == new.name == "system[0]"
    assert first_differing_line("a\nb\nc", "a\nB\nc") == (2, "b", "B")
    assert first_differing_line("a", "a\nb") == (2, "", "b")
    assert split_parts(None) == [] and split_parts({"messages": [3]})[0].role is None
