"""Splicing the values canonicalization changed into the client's bytes gives the canonical body.

Whatever the client's encoder (compact, indented, ASCII-escaped), key order, string contents
(quotes, backslashes, brackets, unicode) and the edit (elements replaced, inserted or removed at
either end or inside, whole values replaced), the spliced bytes parse to exactly the canonical body,
or splicing declines and the body is serialized whole.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.stages.canonicalize import SERIALIZED_BYTES_PER_SCANNED_TOKEN, spliced_body, upstream_bytes

PIECES = [*'ab "\\{}[],:\n\té中', '"messages"', "\\u0041", "\\"]
TEXT = st.lists(st.sampled_from(PIECES), max_size=12).map("".join)
SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False, allow_infinity=False),
    TEXT,
)
VALUE = st.recursive(
    SCALAR,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=8,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.one_of(TEXT, VALUE)}
)
ENCODERS = [
    orjson.dumps,
    lambda b: json.dumps(b).encode(),  # ", " and ": " separators, ASCII escapes
    lambda b: json.dumps(b, ensure_ascii=False, indent=2).encode(),
    lambda b: json.dumps(b, ensure_ascii=False, separators=(" ,", " : ")).encode(),
]


@st.composite
def case(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any]]:
    messages = draw(st.lists(MESSAGE, min_size=1, max_size=6))
    keys = draw(st.permutations(["model", "messages", "tools", "max_tokens", "metadata"]))
    values: dict[str, Any] = {
        "model": draw(TEXT),
        "messages": messages,
        "tools": draw(st.lists(VALUE, max_size=3)),
        "max_tokens": draw(st.integers(1, 100)),
        "metadata": draw(VALUE),
    }
    before = {k: values[k] for k in keys}
    after = dict(before)
    edit = draw(st.sampled_from(["replace", "insert", "remove", "value", "both"]))
    new = list(messages)
    at = draw(st.integers(0, len(messages) - 1))
    if edit in ("replace", "both"):
        new[at] = draw(MESSAGE)
    elif edit == "insert":
        new.insert(draw(st.integers(0, len(messages))), draw(MESSAGE))
    elif edit == "remove":
        del new[at : at + draw(st.integers(1, 2))]
    if edit != "value":
        after["messages"] = new
    if edit in ("value", "both"):
        after["tools"] = draw(st.lists(VALUE, max_size=3))
    return before, after


@settings(max_examples=500, deadline=None)
@given(case(), st.sampled_from(range(len(ENCODERS))))
def test_spliced_bytes_parse_to_the_canonical_body(pair: tuple[dict, dict], encoder: int) -> None:
    before, after = pair
    raw = ENCODERS[encoder](before)
    parsed = orjson.loads(raw)
    # Canonicalization's output shares the parsed body's unchanged objects: rebuild it that way.
    canonical = dict(parsed)
    for key in parsed:
        if after[key] is not before[key]:
            canonical[key] = _share(parsed[key], before[key], after[key])
    spliced = spliced_body(raw, parsed, canonical)
    if spliced is not None:
        assert orjson.dumps(orjson.loads(spliced)) == orjson.dumps(canonical)
    assert spliced is not None, "nothing repeated: the splice must happen"
    assert orjson.dumps(orjson.loads(upstream_bytes(raw, parsed, canonical))) == orjson.dumps(canonical)


def _share(parsed: Any, old: Any, new: Any) -> Any:
    """``new`` with the elements it shares with ``old`` taken from ``parsed`` (the same objects)."""
    if not isinstance(new, list):
        return new
    by_id = {id(o): p for o, p in zip(old, parsed, strict=True)}
    return [by_id.get(id(v), v) for v in new]


def test_a_changed_system_message_is_spliced_into_the_clients_bytes() -> None:
    messages = [{"role": "system", "content": "You are a bot.  "}] + [
        {"role": "user", "content": f"turn {i} " * 50} for i in range(100)
    ]
    raw = orjson.dumps({"model": "m", "messages": messages, "stream": True})
    parsed = orjson.loads(raw)
    canonical = {
        **parsed,
        "messages": [{"role": "system", "content": "You are a bot."}, *parsed["messages"][1:]],
    }
    spliced = spliced_body(raw, parsed, canonical)
    assert spliced is not None and orjson.loads(spliced) == canonical
    assert spliced[len(b'{"model":"m","messages":[') + 50 :] == raw[len(b'{"model":"m","messages":[') + 52 :]
    assert spliced_body(raw, parsed, parsed) is raw


def test_repeated_keys_and_added_keys() -> None:
    canonical = {"model": "m", "messages": [{"role": "user", "content": "c"}]}
    raw = b'{"model":"m","model":"n","messages":[{"role":"user","content":"a"}]}'
    assert spliced_body(raw, orjson.loads(raw), canonical) is None  # repeated before: declined
    # Repeated after the changed value: the client's last value stands, as a parser reads it.
    raw = b'{"model":"m","messages":[{"role":"user","content":"a"}],'
    raw += b'"messa\\u0067es":[{"role":"user","content":"b"}]}'
    spliced = spliced_body(raw, orjson.loads(raw), canonical)
    assert spliced is not None and orjson.loads(spliced) == orjson.loads(raw)
    assert spliced_body(b'{"a":1}', {"a": 1}, {"b": 1}) is None  # a key added or removed


def _agent_body() -> tuple[bytes, dict[str, Any]]:
    """A ~300 KB chat body whose tools follow its messages, and its parse."""
    messages = [{"role": "system", "content": "You are a bot.  "}] + [
        {"role": "user", "content": f"turn {i} " * 200} for i in range(150)
    ]
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {"b": 1}}} for i in range(12)]
    raw = json.dumps({"model": "m", "messages": messages, "tools": tools}).encode()  # not orjson's bytes
    return raw, orjson.loads(raw)


def test_a_change_behind_a_large_unchanged_value_is_serialized_whole() -> None:
    # Scanning 300 KB of messages to reach the tools costs more than serializing the body (~1.2 us a
    # token scanned against ~2.9 KB serialized a us): the whole body is serialized instead.
    raw, parsed = _agent_body()
    canonical = {**parsed, "tools": list(reversed(parsed["tools"]))}
    assert spliced_body(raw, parsed, canonical) is not None  # it can be spliced, at a cost
    assert upstream_bytes(raw, parsed, canonical) == orjson.dumps(canonical)
    # A changed system message, at the front, is spliced: the client's bytes after it are kept.
    canonical = {
        **parsed,
        "messages": [{"role": "system", "content": "You are a bot."}, *parsed["messages"][1:]],
    }
    out = upstream_bytes(raw, parsed, canonical)
    assert orjson.loads(out) == canonical
    after_system = raw[raw.index(b'{"role": "user"') :]
    assert out.endswith(after_system) and len(raw) // SERIALIZED_BYTES_PER_SCANNED_TOKEN < 200


def test_a_small_body_is_serialized_whole() -> None:
    raw = json.dumps({"model": "m", "messages": [{"role": "system", "content": "hi  "}]}).encode()
    parsed = orjson.loads(raw)
    canonical = {**parsed, "messages": [{"role": "system", "content": "hi"}]}
    assert upstream_bytes(raw, parsed, canonical) == orjson.dumps(canonical)  # not the client's spacing
