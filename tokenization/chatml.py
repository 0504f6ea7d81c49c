"""The ChatML-like chat template of the simulated model (and of the default `tiktoken` tokenizer).

One rendering shared by the simulated ranks in ``bench/`` and by prefixgate's own tokenizer, so that
prefixgate's predictions for a simulated rank are exact. The template, Qwen-style:

    <|im_start|>system
    {system text}

    # Tools

    <tools>
    {tool 1 as JSON}
    {tool 2 as JSON}
    </tools><|im_end|>
    <|im_start|>user
    {content}<|im_end|>
    <|im_start|>assistant
    {content}<tool_call>
    {"name": ..., "arguments": ...}
    </tool_call><|im_end|>
    <|im_start|>tool
    {content}<|im_end|>
    <|im_start|>assistant

Rules:
- The first message, when its role is ``system`` (or ``developer``), is the system turn; the tool
  block is appended to it. With tools and no leading system message, the system turn holds only
  the tool block. Later system messages render in place as their own turns.
- A tool renders as ``json.dumps(tool, ensure_ascii=False)``: key order kept, like jinja's
  ``tojson`` in transformers, so drifting key order reaches the tokens exactly as it does on vLLM.
- Content given as a list of parts renders its text parts joined with ``"\\n"`` (vLLM's "string"
  content format); non-text parts render as their JSON.
- ``tool_calls`` render after the content; ``arguments`` as sent (a string stays a string).
- Every turn is a *segment* that starts with ``<|im_start|>``. Special tokens split tokenization,
  so the token ids of a conversation are the concatenation of its segments' ids: this is what lets
  tokenization be incremental per message.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
GENERATION_PROMPT = f"{IM_START}assistant\n"
SYSTEM_ROLES = frozenset({"system", "developer"})


def is_system(message: Mapping[str, Any]) -> bool:
    """Whether ``message`` is a system turn (a role of any other type is not: never a TypeError)."""
    role = message.get("role")
    return isinstance(role, str) and role in SYSTEM_ROLES


def dump_json(value: Any) -> str:
    """JSON the way jinja's ``tojson`` in transformers writes it: key order kept, no ASCII escaping."""
    return json.dumps(value, ensure_ascii=False)


def content_text(content: Any) -> str:
    """The text a message's ``content`` renders to."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
            else:
                parts.append(dump_json(part))
        return "\n".join(parts)
    return dump_json(content)


def tools_block(tools: Sequence[Any]) -> str:
    """The tool section appended to the system turn."""
    lines = "\n".join(dump_json(tool) for tool in tools)
    return f"# Tools\n\n<tools>\n{lines}\n</tools>"


def _tool_calls_text(tool_calls: Any) -> str:
    if not isinstance(tool_calls, list):
        return ""
    out: list[str] = []
    for call in tool_calls:
        fn = call.get("function", call) if isinstance(call, Mapping) else call
        if isinstance(fn, Mapping):
            name = fn.get("name", "")
            arguments = fn.get("arguments", "")
            args = arguments if isinstance(arguments, str) else dump_json(arguments)
            out.append(f'<tool_call>\n{{"name": {dump_json(name)}, "arguments": {args}}}\n</tool_call>')
        else:
            out.append(f"<tool_call>\n{dump_json(fn)}\n</tool_call>")
    return "".join(out)


def render_message(message: Mapping[str, Any]) -> str:
    """One non-system-turn message as its segment text."""
    role = message.get("role", "user")
    body = content_text(message.get("content"))
    if role == "assistant":
        body += _tool_calls_text(message.get("tool_calls"))
    return f"{IM_START}{role}\n{body}{IM_END}\n"


def render_system(system_text: str | None, tools: Sequence[Any] | None) -> str | None:
    """The system turn's segment text, or None when there is neither system text nor tools."""
    if tools:
        block = tools_block(tools)
        text = block if system_text is None else f"{system_text}\n\n{block}"
    elif system_text is None:
        return None
    else:
        text = system_text
    return f"{IM_START}system\n{text}{IM_END}\n"


def render_segments(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
) -> list[str]:
    """The conversation as a list of segment texts, each starting with ``<|im_start|>``."""
    segments: list[str] = []
    rest: Iterable[Mapping[str, Any]] = messages
    system_text: str | None = None
    if messages and is_system(messages[0]):
        system_text = content_text(messages[0].get("content"))
        rest = messages[1:]
    system = render_system(system_text, tools)
    if system is not None:
        segments.append(system)
    segments.extend(render_message(m) for m in rest)
    if add_generation_prompt:
        segments.append(GENERATION_PROMPT)
    return segments


def render(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Any] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The whole prompt text."""
    return "".join(render_segments(messages, tools, add_generation_prompt))
