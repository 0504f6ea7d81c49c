"""Reasoning settings that reach the chat template: the prompt changes while no request part does."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from tests.explain.conftest import Conversation, Prefixgate
from tests.tokenization.conftest import build_model_dir

# A Qwen3-like template: the thinking switch is rendered into the system turn.
THINKING_TEMPLATE = """
{%- if enable_thinking is defined and not enable_thinking %}{%- set mode = '/no_think' %}
{%- else %}{%- set mode = '/think' %}{%- endif %}
{{- '<|im_start|>system\\n' + messages[0].content + '\\n' + mode }}
{%- if tools %}{{- '\\n\\n# Tools\\n\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}{{- '\\n</tools>' }}{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages[1:] %}
{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
""".strip()


def test_reasoning_settings_changed(prefixgate: Callable[..., Prefixgate], tmp_path: Path) -> None:
    model = build_model_dir(tmp_path / "model")
    template = tmp_path / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE, encoding="utf-8")
    tokenization = {"kind": "hf", "path": str(model), "chat_template": str(template), "block_size": 16}
    pg = prefixgate(ranks=1, tokenization=tokenization)
    conv = Conversation("reasoning")
    pg.chat("s-reasoning", conv.turn())
    pg.chat("s-reasoning", conv.turn())
    conv.extra = {"chat_template_kwargs": {"enable_thinking": False}}
    response = pg.chat("s-reasoning", conv.turn())
    breaks = pg.breaks(response)
    assert len(breaks) == 1, breaks
    record = breaks[0]
    assert record["cause"] == "reasoning_changed"
    assert record["turn"] == 2
    assert record["settings"] == {"old": {}, "new": {"chat_template_kwargs": {"enable_thinking": False}}}
    assert record["part"] == "message[0]"  # the hf tokenizer labels its token spans per message
    assert record["block_index"] > 0  # after the system text, which did not change
