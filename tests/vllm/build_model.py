"""Build, offline, the tiny random-weight Llama model the real-vLLM tier serves.

Runs in the vLLM virtualenv (it needs transformers and torch, which prefixgate itself does not):
``~/.cache/prefixgate/vllm-venv/bin/python tests/vllm/build_model.py [--out DIR]``.

The model: Llama architecture, 2 layers, head_dim 32 (the CPU attention backend accepts 32, 64,
80, ...), hidden 64, random weights from a fixed seed; a byte-level BPE tokenizer (vocab 4096)
trained here with ``tokenizers`` on a built-in corpus; a ChatML-like chat template with tools and
tool calls. Its output is gibberish, which is fine: the tier measures prompts, not answers.
Deterministic for a given set of package versions; a stamp file makes reruns no-ops.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path.home() / ".cache" / "prefixgate" / "tiny-llama"
#: Bumped whenever the model, tokenizer or template below changes, so cached folders rebuild.
VERSION = "1"
VOCAB_SIZE = 4096
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Qwen-like: tools inside the system turn, tool calls as JSON in <tool_call>, tool results as
# their own turn. Content that is not a string (vLLM passes text-part lists as one joined string
# for templates like this one) is rendered as sent.
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
{%- if message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}{{- message.content or '' }}
{%- for tc in message.tool_calls or [] %}
{{- '<tool_call>\\n' }}{{- {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}
{{- '\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
""".strip()

_CORPUS = [
    "You are a coding agent. Read the files, run the tests, fix the bug, and explain the change.",
    "def main():\n    print('hello world')\n    return 0\n\nif __name__ == '__main__':\n    main()\n",
    "The quick brown fox jumps over the lazy dog. Prefix caching reuses KV blocks across requests.",
    '{"type": "function", "function": {"name": "read_file", "description": "Read a file", '
    '"parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}',
    "user assistant system tool <tool_call> </tool_call> # Tools <tools> </tools> arguments name",
    "éàü ñ 中文 данные — “quotes” … tabs\tand\nnewlines\r\n",
    "Traceback (most recent call last):\n  File \"app.py\", line 12, in <module>\nKeyError: 'x'\n",
    "$ git diff --stat\n src/app.py | 4 ++--\n 1 file changed, 2 insertions(+), 2 deletions(-)\n",
]


def _corpus() -> list[str]:
    """The built-in texts plus a few stdlib sources: varied code and prose, no download."""
    import argparse as _argparse
    import json as _json
    import textwrap as _textwrap

    texts = list(_CORPUS) * 50
    for module in (_argparse, _json, _textwrap):
        source = Path(module.__file__ or "").read_text(encoding="utf-8")
        texts.extend(source[i : i + 2000] for i in range(0, len(source), 2000))
    return texts


def train_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``, with the ChatML ``SPECIALS``
    (shared with the tiny tokenizer of tests/tokenization)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def build(out: Path) -> Path:
    """Write config, weights, tokenizer and template into ``out``; a no-op when already built."""
    stamp = out / ".prefixgate-model"
    if stamp.exists() and stamp.read_text(encoding="utf-8").strip() == VERSION:
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    core = train_tokenizer(_corpus(), VOCAB_SIZE)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.model_max_length = 8192
    tokenizer.save_pretrained(str(out))

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=core.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=8192,
        eos_token_id=core.token_to_id("<|im_end|>"),
        pad_token_id=core.token_to_id("<|endoftext|>"),
        bos_token_id=None,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(out), safe_serialization=True)
    stamp.write_text(VERSION + "\n", encoding="utf-8")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model folder (outside the repo)")
    args = parser.parse_args(argv)
    path = build(args.out)
    files = sorted(p.name for p in path.iterdir())
    print(json.dumps({"model": str(path), "files": files}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
