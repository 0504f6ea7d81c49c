"""Request bounds: clear 413/400 OpenAI errors, and nothing past them reaches a rank."""

from __future__ import annotations

import httpx
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.ops.limits import json_depth_exceeds
from tests.reliability.conftest import assert_openai_error, chat


def nested(depth: int) -> object:
    """``depth`` containers nested in each other."""
    value: object = "leaf"
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


def depth_of(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((depth_of(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((depth_of(v) for v in value), default=0)
    return 0


def test_bounds_answer_clear_errors_and_spare_the_rank(rank_servers, gateway):
    (stub,) = rank_servers.stub(1)
    rank = stub.behavior
    proxy = gateway([stub], max_messages=3, max_tools=2, max_json_depth=8, max_header_bytes=2048)
    url = proxy.url + "/v1/chat/completions"
    message = {"role": "user", "content": "hi"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [
        ({**chat(), "messages": [message] * 4}, {}, 400, "too_many_messages", "messages"),
        ({**chat(), "tools": [tool] * 3}, {}, 400, "too_many_tools", "tools"),
        ({**chat(), "metadata": nested(8)}, {}, 400, "too_deeply_nested", None),
        (chat(), {"x-big": "a" * 2100}, 413, "headers_too_large", None),
    ]
    for body, headers, status, code, param in cases:
        error = assert_openai_error(httpx.post(url, json=body, headers=headers), status)
        assert error["code"] == code and error["param"] == param
        assert "max_" in error["message"]  # names the setting to raise
    assert rank.received == []
    # at the limits: accepted
    at_limit = {**chat(), "messages": [message] * 3, "tools": [tool] * 2, "metadata": nested(7)}
    assert httpx.post(url, json=at_limit).status_code == 200
    assert_openai_error(httpx.get(proxy.url + "/v1/models", headers={"x-big": "a" * 2100}), 413)


def test_orjson_depth_limit_is_a_400_not_a_crash(rank_servers, gateway):
    (stub,) = rank_servers.stub(1)
    proxy = gateway([stub], max_json_depth=5000)
    body = b'{"model": "m", "messages": ' + b"[" * 3000 + b"]" * 3000 + b"}"
    assert_openai_error(httpx.post(proxy.url + "/v1/chat/completions", content=body), 400)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=3),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=2), children, max_size=3)
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(json_values, st.integers(min_value=1, max_value=12))
def test_depth_check_agrees_with_a_recursive_definition(value, limit):
    assert json_depth_exceeds(value, limit) == (depth_of(value) > limit)
