"""Fixtures: a tiny Hugging Face model directory (BPE trained here, ChatML-like template with tools)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.vllm.build_model import train_tokenizer
from tokenization.hf_tokenizer import HfTokenizer

# Qwen-style: tools inside the system turn, tool calls as JSON in <tool_call>, loop controls, the
# {% generation %} tag, raise_exception and tojson on a dict literal (key order must survive).
CHAT_TEMPLATE = """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' and loop.first %}{%- continue %}{%- endif %}
{%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}
{{- raise_exception('unknown role ' + message.role) }}
{%- endif %}
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}{% generation %}{{- message.content or '' }}
{%- for tc in message.tool_calls or [] %}
{{- '<tool_call>\\n' }}{{- {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}
{{- '\\n</tool_call>' }}
{%- endfor %}{% endgeneration %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
""".strip()

TRAINING_TEXT = [
    "You are a coding agent. Read the files, run the tests, fix the bug.",
    "def main():\n    print('hello world')\n    return 0\n",
    "The quick brown fox jumps over the lazy dog. Prefix caching reuses KV blocks.",
    '{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}',
    "user assistant system tool <tool_call> </tool_call> # Tools <tools> </tools>",
    "éàü ñ 中文 данные — “quotes” … tabs\tand\nnewlines\r\n",
]


def build_model_dir(path: Path) -> Path:
    """A model directory with tokenizer.json (byte-level BPE, vocab 600) and tokenizer_config.json."""
    tok = train_tokenizer(TRAINING_TEXT * 20, vocab_size=600)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_dir(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def build_hf_model() -> Callable[[Path], Path]:
    """``build_model_dir`` for tests that modify the model directory."""
    return build_model_dir


@pytest.fixture(scope="module")
def hf_tokenizer(hf_model_dir: Path) -> HfTokenizer:
    """One tokenizer of the tiny model per test module (loading it is the slow part)."""
    return HfTokenizer(hf_model_dir)
