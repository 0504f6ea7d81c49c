"""The agents' own APIs as chat-completions requests, converted the way vLLM converts them.

vLLM serves the Anthropic Messages API (``/v1/messages``) and OpenAI's Responses API
(``/v1/responses``) by turning each request into chat messages and tools, then applying the same
chat template as ``/v1/chat/completions``. prefixgate must predict the rank's tokens, and the
simulated rank must cache like a real one, so both use these functions: they cannot disagree.

What is mirrored (vLLM's ``entrypoints/anthropic`` and ``entrypoints/openai/responses``):

Anthropic Messages
- ``system`` (a string, or text blocks) and any ``system``-role message become one system message,
  the texts concatenated with no separator; text blocks starting with Claude Code's
  ``x-anthropic-billing-header`` are skipped (vLLM drops them: their per-request hash would defeat
  prefix caching). ``cache_control`` markers do not reach the template.
- In a message: text blocks become text parts (a single one becomes the string content),
  ``tool_use`` becomes a ``tool_calls`` entry with ``json.dumps(input)`` arguments, ``thinking``
  becomes ``reasoning``; a user's ``tool_result`` becomes a ``tool`` message placed before what is
  left of that user message (dropped when nothing is left). Roles ``ctx``/``msg`` read as ``user``.
- Tools ``{name, description, input_schema}`` become ``{"type": "function", "function": {name,
  description, parameters}}`` (``input_schema`` without ``type`` gets ``"type": "object"``).

Responses
- ``instructions`` becomes a leading system message; with ``previous_response_id`` the stored
  conversation (minus its system messages) and the previous output come next; then ``input``: a
  string is one user message; items convert one by one: ``function_call`` joins the preceding
  assistant message's ``tool_calls`` (or starts one), ``function_call_output`` becomes a ``tool``
  message, an assistant message keeps its first text part, ``reasoning`` becomes ``reasoning``, and
  any other item (user, system, developer messages) passes through as a chat message whose
  ``input_text``/``output_text`` parts are text parts (vLLM's content parser reads them as text).
- Function tools ``{type, name, description, parameters, strict}`` become chat function tools;
  other tool types (web search, MCP, ...) do not reach the template.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

#: Claude Code's per-request attribution line; vLLM skips system blocks that start with it.
BILLING_HEADER_PREFIX = "x-anthropic-billing-header"
#: Roles recent Claude Code versions send that vLLM maps to ``user``.
ANTHROPIC_ROLE_ALIASES = {"ctx": "user", "msg": "user"}
#: Responses content part types that vLLM's chat content parser reads as plain text.
RESPONSES_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


class ConversionError(ValueError):
    """The request's shape cannot be converted (the rank would reject it too)."""


# -- Anthropic Messages ---------------------------------------------------------------------------
def _system_text_and_messages(body: Mapping[str, Any]) -> tuple[str | None, list[Mapping[str, Any]]]:
    """The system message text vLLM builds from ``system`` and system-role messages (None: none),
    and the validated ``messages``, so callers validate them once."""
    parts: list[str] = []
    system = body.get("system")
    if isinstance(system, str):
        if system:
            parts.append(system)
    elif isinstance(system, list):
        parts.extend(_anthropic_system_blocks(system))
    elif system is not None:
        raise ConversionError("'system' must be a string or a list of text blocks")
    messages = _anthropic_messages(body)
    for message in messages:
        if message.get("role") != "system":
            continue
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(_anthropic_system_blocks(content))
    return ("".join(parts) if parts else None), messages


def _anthropic_system_blocks(blocks: Sequence[Any]) -> list[str]:
    out: list[str] = []
    for block in blocks:
        if not isinstance(block, Mapping):
            raise ConversionError("system blocks must be objects")
        text = block.get("text")
        if block.get("type") != "text" or not isinstance(text, str) or not text:
            continue
        if not text.startswith(BILLING_HEADER_PREFIX):
            out.append(text)
    return out


def _anthropic_messages(body: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
        raise ConversionError("'messages' must be a list of objects")
    return messages


def anthropic_messages_to_chat(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of an Anthropic Messages request (system message first, when any)."""
    out: list[dict[str, Any]] = []
    system, messages = _system_text_and_messages(body)
    if system is not None:
        out.append({"role": "system", "content": system})
    for message in messages:
        role = message.get("role")
        role = ANTHROPIC_ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role == "system":
            continue
        if role not in ("user", "assistant"):
            raise ConversionError(f"message role must be 'user' or 'assistant', got {role!r}")
        content = message.get("content")
        converted: dict[str, Any] = {"role": role}
        if isinstance(content, str):
            converted["content"] = content
        elif isinstance(content, list):
            _anthropic_blocks(role, content, converted, out)
        else:
            raise ConversionError("message content must be a string or a list of blocks")
        if not (role == "user" and "content" not in converted):
            out.append(converted)
    return out


def _anthropic_blocks(
    role: str, blocks: Sequence[Any], converted: dict[str, Any], out: list[dict[str, Any]]
) -> None:
    parts: list[dict[str, Any]] = []
    tool_calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in blocks:
        if not isinstance(block, Mapping):
            raise ConversionError("content blocks must be objects")
        kind = block.get("type")
        if kind == "text":
            if block.get("text"):
                parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            source = block.get("source")
            if isinstance(source, Mapping):
                parts.append({"type": "image_url", "image_url": {"url": _image_url(source)}})
        elif kind == "thinking":
            if block.get("thinking") is not None:
                reasoning.append(str(block["thinking"]))
        elif kind == "tool_use":
            tool_calls.append(
                {
                    "id": block.get("id") or "call_0",
                    "type": "function",
                    "function": {
                        "name": block.get("name") or "",
                        "arguments": json.dumps(block.get("input") or {}),
                    },
                }
            )
        elif kind == "tool_result":
            result = block.get("content")
            if role == "user":
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.get("tool_use_id") or "",
                        "content": _tool_result_text(result),
                    }
                )
            else:
                parts.append({"type": "text", "text": f"Tool result: {str(result) if result else ''}"})
        # redacted_thinking, tool_reference and unknown blocks do not reach the template
    if reasoning:
        converted["reasoning"] = "".join(reasoning)
    if tool_calls:
        converted["tool_calls"] = tool_calls
    if parts:
        only_text = len(parts) == 1 and parts[0]["type"] == "text"
        converted["content"] = parts[0]["text"] if only_text else parts


def _image_url(source: Mapping[str, Any]) -> str:
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _tool_result_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(
            str(item.get("text", ""))
            for item in content
            if isinstance(item, Mapping) and item.get("type") == "text"
        )
    return ""


def anthropic_tool_to_chat(tool: Mapping[str, Any]) -> dict[str, Any]:
    """One Anthropic tool as the chat tool vLLM hands to the template."""
    name = tool.get("name")
    schema = tool.get("input_schema")
    if not isinstance(name, str) or not isinstance(schema, Mapping):
        raise ConversionError("each tool needs a string 'name' and an object 'input_schema'")
    if "type" not in schema:
        schema = {**schema, "type": "object"}
    return {
        "type": "function",
        "function": {"name": name, "description": tool.get("description"), "parameters": schema},
    }


def anthropic_tools_to_chat(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise ConversionError("'tools' must be a list of objects")
    return [anthropic_tool_to_chat(t) for t in tools]


def anthropic_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions body vLLM derives from an Anthropic Messages (or count_tokens) body."""
    chat: dict[str, Any] = {"messages": anthropic_messages_to_chat(body)}
    tools = anthropic_tools_to_chat(body)
    if tools:
        chat["tools"] = tools
    for key in ("model", "max_tokens", "stream", "chat_template_kwargs"):
        if key in body:
            chat[key] = body[key]
    return chat


# -- OpenAI Responses -----------------------------------------------------------------------------
def responses_input_to_chat(items: Sequence[Any]) -> list[dict[str, Any]]:
    """Responses ``input`` items as chat messages."""
    out: list[dict[str, Any]] = []
    for item in items:
        if not isinstance(item, Mapping):
            raise ConversionError("'input' items must be objects")
        message = _responses_item(item, out[-1] if out else None)
        if message is not None:
            out.append(message)
    return out


def _responses_item(item: Mapping[str, Any], prev: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat message for ``item``, or None when it merged into ``prev`` (an assistant message)."""
    assistant = prev if prev is not None and prev.get("role") == "assistant" else None
    kind = item.get("type")
    if kind == "function_call":
        call = {
            "id": item.get("call_id"),
            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            "type": "function",
        }
        if assistant is not None and isinstance(assistant.get("tool_calls", []), list):
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "content": item.get("output"), "tool_call_id": item.get("call_id")}
    if kind == "reasoning":
        text = _first_text(item.get("content")) or _first_text(item.get("summary")) or ""
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = text
            return None
        return {"role": "assistant", "reasoning": text}
    if item.get("role") == "assistant":
        content = item.get("content")
        text = content if isinstance(content, str) else (_first_text(content) or "")
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    return _passthrough(item)


def _first_text(parts: Any) -> str | None:
    if isinstance(parts, list) and parts:
        first = parts[0]
        return str(first.get("text", "")) if isinstance(first, Mapping) else str(first)
    return None


def is_one_of(value: Any, names: frozenset[str]) -> bool:
    """Whether ``value`` is one of ``names``: a client's list or object there is none of them (a set
    lookup would raise TypeError, a 500 for the client's mistake)."""
    return isinstance(value, str) and value in names


def _passthrough(item: Mapping[str, Any]) -> dict[str, Any]:
    message = dict(item)
    content = message.get("content")
    if isinstance(content, list):
        message["content"] = [
            {"type": "text", "text": p.get("text", "")}
            if isinstance(p, Mapping) and is_one_of(p.get("type"), RESPONSES_TEXT_PARTS)
            else p
            for p in content
        ]
    return message


def responses_tool_to_chat(tool: Mapping[str, Any]) -> dict[str, Any] | None:
    """A Responses tool as a chat tool; None for tools that are not functions."""
    if tool.get("type") != "function":
        return None
    if not isinstance(tool.get("name"), str):
        raise ConversionError("a function tool needs a string 'name'")
    function: dict[str, Any] = {
        "name": tool["name"],
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
    }
    function.update((k, v) for k, v in tool.items() if k not in function and k != "type")
    return {"type": "function", "function": function}


def responses_tools_to_chat(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, Mapping) for t in tools):
        raise ConversionError("'tools' must be a list of objects")
    converted = [responses_tool_to_chat(t) for t in tools]
    return [t for t in converted if t is not None]


def responses_messages_to_chat(
    body: Mapping[str, Any], previous: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The chat messages of a Responses request; ``previous``: the stored conversation, output included."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ConversionError("'instructions' must be a string")
    if instructions:
        out.append({"role": "system", "content": instructions})
    if previous:
        out.extend(dict(m) for m in previous if m.get("role") != "system")
    items = body.get("input")
    if isinstance(items, str):
        out.append({"role": "user", "content": items})
    elif isinstance(items, list):
        out.extend(responses_input_to_chat(items))
    else:
        raise ConversionError("'input' must be a string or a list of items")
    return out


def responses_to_chat(
    body: Mapping[str, Any], previous: Sequence[Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """The chat-completions body vLLM derives from a Responses body (``previous``: see above)."""
    chat: dict[str, Any] = {"messages": responses_messages_to_chat(body, previous)}
    tools = responses_tools_to_chat(body)
    if tools:
        chat["tools"] = tools
    # cache_salt is a vLLM extra of its Responses endpoint: it salts block 0 like a chat request's
    for key in ("model", "stream", "prompt_cache_key", "user", "cache_salt"):
        if key in body:
            chat[key] = body[key]
    if isinstance(body.get("max_output_tokens"), int):
        chat["max_tokens"] = body["max_output_tokens"]
    return chat
