"""``vllm_messages``: the message conversion vLLM 0.32 applies before the template (checked against a
real rank's ``/tokenize`` in tests/vllm; these pin the rules offline)."""

from __future__ import annotations

from typing import Any

import pytest

from tokenization.base import UnsupportedRequest
from tokenization.hf_tokenizer import vllm_messages


def _call(arguments: Any) -> dict[str, Any]:
    return {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [('{"a": 1}', {"a": 1}), ("", {}), (None, {}), ('{"a": ', {}), ("[1, 2]", {}), ({"b": 2}, {"b": 2})],
)
def test_tool_call_arguments_always_reach_the_template_as_objects(arguments: Any, expected: Any) -> None:
    out = vllm_messages([{"role": "assistant", "content": None, "tool_calls": [_call(arguments)]}])
    assert out[0] == {"role": "assistant", "content": "", "tool_calls": [_call(expected)]}


def test_plain_messages_pass_through_uncopied() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u", "name": "me"}]
    out = vllm_messages(messages)
    assert all(a is b for a, b in zip(out, messages, strict=True))


def test_keys_vllm_drops_and_keeps() -> None:
    out = vllm_messages(
        [
            {"role": "user", "content": "u", "cache_control": {"type": "ephemeral"}, "name": None},
            {"role": "assistant", "content": "a", "tool_calls": [], "reasoning": "r", "refusal": None},
            {"role": "tool", "content": "t", "tool_call_id": "c", "extra": 1},
        ]
    )
    assert out == [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a", "reasoning": "r", "reasoning_content": "r"},
        {"role": "tool", "content": "t", "tool_call_id": "c"},
    ]


def test_text_parts_are_joined_and_empty_parts_skipped() -> None:
    parts = [
        {"type": "text", "text": "a"},
        "b",
        {"type": "text", "text": None},
        {"type": "refusal", "refusal": "c"},
    ]
    assert vllm_messages([{"role": "user", "content": parts}])[0]["content"] == "a\nb\nc"
    with pytest.raises(UnsupportedRequest):
        vllm_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_claude_code_billing_line_leaves_system_text_only() -> None:
    header = "x-anthropic-billing-header: cc_version=2; cch=1"
    out = vllm_messages(
        [
            {"role": "system", "content": f"{header}\nYou are Claude."},
            {
                "role": "system",
                "content": [{"type": "text", "text": header}, {"type": "text", "text": "Hi."}],
            },
            {"role": "user", "content": f"{header}\nkept in user turns"},
        ]
    )
    assert [m["content"] for m in out] == ["You are Claude.", "Hi.", f"{header}\nkept in user turns"]


def test_the_request_is_not_mutated() -> None:
    message = {"role": "assistant", "content": [{"type": "text", "text": "x"}], "tool_calls": [_call("{}")]}
    vllm_messages([message])
    assert message["tool_calls"][0]["function"]["arguments"] == "{}" and isinstance(message["content"], list)
