"""``hf`` tokenization builds exactly the token ids a real vLLM rank builds (its ``POST /tokenize``)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.helpers.real_vllm import TOOLS
from tests.vllm.ranks import SERVED_MODEL, VllmRank
from tokenization.base import ChatPrompt
from tokenization.hf_tokenizer import HfTokenizer


def _call(arguments: Any, content: Any = None) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": arguments}}
        ],
    }


_RESULT = {"role": "tool", "tool_call_id": "c1", "content": "def f():\n    return 1\n"}
_USER = {"role": "user", "content": "Fix the failing test in tests/test_area.py, please."}

SHAPES: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = {
    "system_and_tools": ([{"role": "system", "content": "You are a coding agent."}, _USER], TOOLS),
    "multi_turn": (
        [
            {"role": "system", "content": "You are terse."},
            _USER,
            {"role": "assistant", "content": "Which test?"},
            {"role": "user", "content": "test_area — «the» one\twith tabs"},
        ],
        None,
    ),
    "tool_call": ([_USER, _call('{"path": "src/area.py"}'), _RESULT], TOOLS),
    "tool_call_with_text": ([_USER, _call('{"path": "a.py"}', content="Reading."), _RESULT], TOOLS),
    # vLLM coerces arguments that are empty, not JSON or not an object to {}.
    "tool_call_malformed_arguments": ([_USER, _call('{"path": "a.py"'), _RESULT], TOOLS),
    "tool_call_array_arguments": ([_USER, _call("[1, 2]"), _RESULT], TOOLS),
    "tool_call_empty_arguments": ([_USER, _call(""), _RESULT], TOOLS),
    "list_content": (
        [
            {
                "role": "system",
                "content": [{"type": "text", "text": "Part one."}, {"type": "text", "text": "Two."}],
            },
            {
                "role": "user",
                "content": [{"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}}],
            },
        ],
        None,
    ),
    "tool_result_parts": (
        [
            _USER,
            _call("{}"),
            {**_RESULT, "content": [{"type": "text", "text": "r1"}, {"type": "text", "text": "r2"}]},
        ],
        TOOLS,
    ),
    "empty_tool_calls": ([_USER, {"role": "assistant", "content": "ok", "tool_calls": []}, _USER], None),
    # Claude Code's per-request billing line: vLLM drops it from system text.
    "billing_header": (
        [
            {
                "role": "system",
                "content": "x-anthropic-billing-header: cc_version=2.1; cch=9f1\nYou are Claude.",
            },
            _USER,
        ],
        None,
    ),
}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_token_ids_equal_vllm_tokenize(
    shape: str, ranks: list[VllmRank], client: httpx.Client, tok: HfTokenizer
) -> None:
    messages, tools = SHAPES[shape]
    body: dict[str, Any] = {"model": SERVED_MODEL, "messages": messages}
    if tools:
        body["tools"] = tools
    response = client.post(f"{ranks[0].url}/tokenize", json=body)
    assert response.status_code == 200, response.text
    expected = response.json()["tokens"]
    ours = list(tok.encode_chat(ChatPrompt(messages, tools)).tokens)
    assert ours == expected, (tok.render(ChatPrompt(messages, tools)), tok.decode(expected, False))


def test_incremental_turns_equal_vllm_tokenize(
    ranks: list[VllmRank], client: httpx.Client, tok: HfTokenizer
) -> None:
    # Each turn encoded from the previous one's memo must equal a from-scratch /tokenize.
    prev = None
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent."}]
    for turn in range(4):
        messages = [
            *messages,
            {"role": "user", "content": f"step {turn}"},
            _call(f'{{"path": "f{turn}"}}'),
            _RESULT,
        ]
        prev = tok.encode_chat(ChatPrompt(messages, TOOLS), prev)
        body = {"model": SERVED_MODEL, "messages": messages, "tools": TOOLS}
        expected = client.post(f"{ranks[1].url}/tokenize", json=body).json()["tokens"]
        assert list(prev.tokens) == expected, turn
