"""The tiktoken tokenizer is exactly cl100k + ChatML, per segment and incrementally."""

from __future__ import annotations

import pytest

from tokenization.base import ChatPrompt, UnsupportedRequest
from tokenization.tiktoken_tokenizer import TiktokenTokenizer, encode, render, segment_labels

TOOLS = [
    {"type": "function", "function": {"name": "bash", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "read", "description": "Read a file. 读"}},
]
MESSAGES = [
    {"role": "system", "content": "You are a coding agent.\n\nBe careful."},
    {"role": "user", "content": [{"type": "text", "text": "Fix it"}, {"type": "text", "text": "now"}]},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "a.py\nb.py <|im_end|> literal"},
    {"role": "user", "content": "  leading spaces and trailing\n\n"},
]


@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("cut", [0, 1, 2, 5])
@pytest.mark.parametrize("generation", [True, False])
def test_ids_equal_encoding_of_render(tools: list | None, cut: int, generation: bool) -> None:
    messages = MESSAGES[cut:] if cut < 5 else []
    enc = TiktokenTokenizer().encode_chat(ChatPrompt(messages, tools, generation))
    assert list(enc.tokens) == encode(render(messages, tools, generation))
    # Parts tile the prompt, one per segment.
    labels = segment_labels(messages, tools, generation)
    assert [p[0] for p in enc.parts] == labels
    assert enc.parts[0][1] == 0 if enc.parts else True
    assert all(a[2] == b[1] for a, b in zip(enc.parts, enc.parts[1:], strict=False))
    if enc.parts:
        assert enc.parts[-1][2] == len(enc.tokens)


def test_part_labels() -> None:
    assert segment_labels(MESSAGES, TOOLS, True)[:2] == ["system+tools", "message[1]"]
    assert segment_labels(MESSAGES[1:], TOOLS, False)[0] == "tools"
    assert segment_labels(MESSAGES[1:], None, True)[-1] == "generation_prompt"


def test_incremental_reencodes_only_changed_segments() -> None:
    tok = TiktokenTokenizer()
    first = tok.encode_chat(ChatPrompt(MESSAGES[:3], TOOLS))
    # The trailing generation prompt becomes an assistant turn: everything before it is reused.
    second = tok.encode_chat(ChatPrompt(MESSAGES, TOOLS), first)
    assert second.reused == first.parts[-1][1]
    assert list(second.tokens) == encode(render(MESSAGES, TOOLS))
    edited = [MESSAGES[0], {"role": "user", "content": "changed"}, *MESSAGES[2:]]
    third = tok.encode_chat(ChatPrompt(edited, TOOLS), second)
    assert third.reused == second.parts[0][2]
    assert list(third.tokens) == encode(render(edited, TOOLS))
    assert list(second.tokens) == encode(render(MESSAGES, TOOLS))  # prev untouched


@pytest.mark.parametrize(
    "body",
    [
        {},
        {"messages": "hi"},
        {"messages": [1]},
        {"messages": [], "tools": {}},
        {"messages": [], "chat_template_kwargs": 3},
    ],
)
def test_malformed_bodies_are_rejected(body: dict) -> None:
    with pytest.raises(UnsupportedRequest):
        ChatPrompt.from_body(body)
