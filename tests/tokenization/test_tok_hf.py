"""hf mode: a tokenizer and chat template built in the test (no download), rendered like transformers."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tokenization.base import ChatPrompt
from tokenization.hf_template import TemplateError, load_chat_template, render_chat, select_template
from tokenization.hf_tokenizer import HfTokenizer, vllm_messages

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "edit",
            "parameters": {
                "type": "object",
                "properties": {"z": {"type": "string"}, "a": {"type": "integer"}},
            },
            "description": "Édite — «file»",
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Fix the bug in main.py"},
    {
        "role": "assistant",
        "content": "Looking.",
        "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "edit", "arguments": '{"z": "x", "a": 1}'}}
        ],
    },
    {"role": "tool", "content": "done"},
]


@pytest.fixture(scope="module")
def tok(hf_model_dir: Path) -> HfTokenizer:
    return HfTokenizer(hf_model_dir)


def test_render_matches_the_template_semantics(tok: HfTokenizer) -> None:
    text = tok.render(ChatPrompt(MESSAGES, TOOLS))
    # tojson keeps key order and non-ASCII; arguments strings reach the template as objects (vLLM).
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert '{"name": "edit", "arguments": {"z": "x", "a": 1}}' in text
    assert text.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n\n<tools>\n")
    assert text.endswith("<|im_start|>tool\ndone<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.render(ChatPrompt(MESSAGES, TOOLS, add_generation_prompt=False)).endswith("assistant\n")


def test_ids_and_parts(tok: HfTokenizer) -> None:
    prompt = ChatPrompt(MESSAGES, TOOLS)
    enc = tok.encode_chat(prompt)
    assert list(enc.tokens) == tok.encode_text(tok.render(prompt))
    im_start = tok.token_id("<|im_start|>")
    assert enc.tokens.count(im_start) == 5  # the special token is one id, never split into bytes
    labels = [p[0] for p in enc.parts]
    assert labels == ["message[0]", "message[1]", "message[2]", "message[3]"]
    assert enc.parts[0][1] == 0 and enc.parts[-1][2] == len(enc.tokens)
    for label, start, _ in enc.parts[1:]:
        assert enc.tokens[start] == im_start, label


def test_edit_reencodes_from_the_turn_before_the_change(tok: HfTokenizer) -> None:
    first = tok.encode_chat(ChatPrompt(MESSAGES, TOOLS))
    edited = [*MESSAGES[:3], {"role": "tool", "content": "done, with more output"}]
    second = tok.encode_chat(ChatPrompt(edited, TOOLS), first)
    assert list(second.tokens) == tok.encode_text(tok.render(ChatPrompt(edited, TOOLS)))
    assert first.parts[3][1] <= second.reused < len(second.tokens)


def test_template_errors_and_globals(tmp_path: Path) -> None:
    with pytest.raises(TemplateError, match="unknown role"):
        render_chat("{{ raise_exception('unknown role') }}", [], None, True, {})
    assert render_chat("{{ strftime_now('%Y') }}", [], None, True, {}).isdigit()
    # Immutable sandbox: templates cannot mutate the request.
    with pytest.raises(TemplateError):
        render_chat("{% set _ = messages.append(1) %}", [], None, True, {})
    # Special tokens and chat_template_kwargs reach the template; reserved names cannot be overridden.
    out = render_chat(
        "{{ bos_token }}{{ flag }}{{ messages | length }}",
        [{}],
        None,
        True,
        {"bos_token": "<s>"},
        {
            "flag": "on",
            "messages": [],
        },
    )
    assert out == "<s>on1"


def test_template_sources(tmp_path: Path, hf_model_dir: Path) -> None:
    named = tmp_path / "named"
    named.mkdir()
    config = {
        "bos_token": {"content": "<s>", "special": True},
        "chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}],
    }
    (named / "tokenizer_config.json").write_text(json.dumps(config))
    template, special = load_chat_template(named)
    assert special == {"bos_token": "<s>"}
    assert (
        select_template(template, has_tools=True) == "T" and select_template(template, has_tools=False) == "D"
    )
    (named / "chat_template.jinja").write_text("J")
    assert load_chat_template(named)[0] == "J"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TemplateError):
        load_chat_template(empty)


def test_vllm_message_preprocessing_does_not_mutate_the_request() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": ""}}]},
    ]
    out = vllm_messages(messages)
    assert out[0]["content"] == "a\nb" and out[1]["tool_calls"][0]["function"]["arguments"] == {}
    assert (
        isinstance(messages[0]["content"], list)
        and messages[1]["tool_calls"][0]["function"]["arguments"] == ""
    )


async def test_completion_adds_special_tokens(tmp_path: Path, build_hf_model: Callable[[Path], Path]) -> None:
    from tokenizers import Tokenizer, processors

    model = build_hf_model(tmp_path / "m")
    core = Tokenizer.from_file(str(model / "tokenizer.json"))
    bos = core.token_to_id("<|endoftext|>")
    core.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos)]
    )
    core.save(str(model / "tokenizer.json"))
    tok = HfTokenizer(model)
    enc = (await tok.plan_text("hello world", None)).finish()
    assert enc.tokens[0] == bos and list(enc.tokens[1:]) == tok.encode_text("hello world")
    chat = tok.encode_chat(ChatPrompt([{"role": "user", "content": "hello"}]))
    assert bos not in chat.tokens  # chat prompts: the template owns BOS, vLLM adds none
