"""The simulated rank's scripted-tool mode: answer agent requests with calls to their shell tool.

With ``SimConfig.scripted_tool_calls`` = K, a request that offers a shell tool (Claude Code's
``Bash``, Codex's ``exec_command`` or ``shell``, opencode's ``bash``, Cline's ``execute_command``)
is answered with a call to it, built from the tool's JSON schema, until the conversation holds K
calls per user turn; then with a final text. A request without such a tool (a title generator, a
topic check) gets the final text at once. With ``SimConfig.scripted_subagents`` a conversation
offering a sub-agent tool (Claude Code's ``Agent``, opencode's ``task``) first calls it once, so the
agent runs a sub-agent conversation of its own under the same session. So a real agent CLI runs
multi-turn sessions with tool calls through prefixgate against the simulator, with no model.

The answer is generated as a model would write it: its tokens are those the chat template renders
for the assistant turn (``tokenization.tiktoken_tokenizer``: content, then ``<tool_call>`` JSON), so
the agent sending it back in its next request reproduces the blocks the rank cached while decoding,
as on vLLM. The API layers turn a call into their own shapes (chat ``tool_calls``, Anthropic
``tool_use``, Responses ``function_call``), whole or streamed.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.sim.sequences import OUTPUT_TOKEN_IDS
from tokenization.tiktoken_tokenizer import GENERATION_PROMPT, IM_END, encode, render_message

#: Shell tools of today's agents, by the name they give it.
SHELL_TOOLS = ("Bash", "bash", "exec_command", "shell", "execute_command", "run_command", "run_shell_command")
#: Sub-agent tools of today's agents, and the agent type each is asked for.
AGENT_TOOLS = {"Agent": "general-purpose", "Task": "general-purpose", "task": "general"}
#: Words of the final answer (each one token of the simulated model's vocabulary).
FINAL_WORDS = 12
_COMMAND_KEYS = ("command", "cmd")


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call to one tool: its id, name and JSON arguments (as the API carries them)."""

    id: str
    name: str
    arguments: str

    @property
    def input(self) -> Any:
        return json.loads(self.arguments)


@dataclass(frozen=True, slots=True)
class Script:
    """The answer a scripted request generates: its tokens, and the call they spell (None: text)."""

    token_ids: tuple[int, ...]
    call: ToolCall | None


def _function(tool: Any) -> Mapping[str, Any] | None:
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    return fn if isinstance(fn, Mapping) and isinstance(fn.get("name"), str) else None


def shell_tool(tools: Sequence[Any] | None) -> Mapping[str, Any] | None:
    """The request's shell tool (chat form ``{"type": "function", "function": {...}}``), if any."""
    by_name = {fn["name"]: fn for fn in map(_function, tools or ()) if fn is not None}
    return next((by_name[name] for name in SHELL_TOOLS if name in by_name), None)


def _value(name: str, schema: Any, step: int) -> Any:
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    command = f"echo prefixgate-step-{step} && ls"
    if kind == "array":
        return ["bash", "-lc", command]
    if kind in ("integer", "number"):
        return 10_000
    if kind == "boolean":
        return False
    if kind == "object":
        return {}
    return command if name in _COMMAND_KEYS else f"step {step}"


def shell_arguments(tool: Mapping[str, Any], step: int) -> dict[str, Any]:
    """Arguments for the shell tool: every required property, plus the command whatever it is called."""
    schema = tool.get("parameters")
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    props = props if isinstance(props, Mapping) else {}
    required = schema.get("required") if isinstance(schema, Mapping) else None
    names = [n for n in required if isinstance(n, str)] if isinstance(required, list) else []
    names += [n for n in _COMMAND_KEYS if n in props and n not in names]
    return {name: _value(name, props.get(name), step) for name in names}


def agent_tool(tools: Sequence[Any] | None) -> Mapping[str, Any] | None:
    """The request's sub-agent tool (chat form), if any."""
    return next(
        (fn for fn in map(_function, tools or ()) if fn is not None and fn["name"] in AGENT_TOOLS), None
    )


def _called(messages: Sequence[Mapping[str, Any]], name: str) -> bool:
    for message in messages:
        for call in message.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, Mapping) else None
            if isinstance(fn, Mapping) and fn.get("name") == name:
                return True
    return False


def _user_turns_and_calls(messages: Sequence[Mapping[str, Any]]) -> tuple[int, int]:
    """User turns (runs of user messages not answering a tool) and tool calls made so far."""
    turns = calls = 0
    previous: str | None = None
    for message in messages:
        role = message.get("role")
        if role == "user" and previous not in ("tool", "user"):
            turns += 1
        elif role == "assistant" and isinstance(message.get("tool_calls"), list):
            calls += len(message["tool_calls"])
        previous = role if isinstance(role, str) else None
    return turns, calls


def _answer_tokens(message: dict[str, Any]) -> tuple[int, ...]:
    """The tokens a model generates for ``message``: its rendered turn after the generation prompt,
    up to (not including) the end-of-turn marker."""
    rendered = encode(render_message(message))
    head = encode(GENERATION_PROMPT)
    tail = encode(IM_END + "\n")
    if rendered[: len(head)] == head and rendered[-len(tail) :] == tail:
        return tuple(rendered[len(head) : len(rendered) - len(tail)])
    body = render_message(message)[len(GENERATION_PROMPT) : -len(IM_END) - 1]
    return tuple(encode(body))


def final_text_tokens(seed: int) -> tuple[int, ...]:
    """The final answer: ``FINAL_WORDS`` words of the simulated vocabulary."""
    words = OUTPUT_TOKEN_IDS
    return tuple(words[(seed + k) % len(words)] for k in range(FINAL_WORDS))


def script_for(chat: Mapping[str, Any], calls_per_turn: int, subagents: bool = False) -> Script | None:
    """The scripted answer to a chat-form request (None: scripted mode is off)."""
    if calls_per_turn <= 0:
        return None
    messages = chat.get("messages") or []
    tool = shell_tool(chat.get("tools"))
    turns, calls = _user_turns_and_calls(messages)
    agent = agent_tool(chat.get("tools")) if subagents else None
    if agent is not None and not _called(messages, str(agent["name"])):
        name = str(agent["name"])
        args = {
            "description": "Survey the files",
            "prompt": "List the files and report.",
            "subagent_type": AGENT_TOOLS[name],
        }
        arguments = json.dumps(args)
    elif tool is None or calls >= calls_per_turn * max(turns, 1):
        return Script(final_text_tokens(len(messages)), None)
    else:
        name = str(tool["name"])
        arguments = json.dumps(shell_arguments(tool, calls + 1))
    call = ToolCall(f"call_{uuid.uuid4().hex[:24]}", name, arguments)
    message = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}
        ],
    }
    return Script(_answer_tokens(message), call)


# -- the call in each API's shapes (whole answers, and the SSE events of a stream) ----------------
def _sse(name: str | None, data: dict[str, Any]) -> bytes:
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + json.dumps(data).encode() + b"\n\n"


def chat_message(call: ToolCall) -> dict[str, Any]:
    """The ``choices[].message`` of a chat completion calling ``call``."""
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        ],
    }


def chat_chunks(call: ToolCall, head: dict[str, Any], usage: dict[str, Any] | None) -> list[bytes]:
    """A streamed chat completion calling ``call`` (``head``: the chunks' id, object, created, model)."""
    delta = {
        "role": "assistant",
        "tool_calls": [
            {
                "index": 0,
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
        ],
    }
    chunks = [
        _sse(
            None, {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
        ),
        _sse(
            None,
            {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}]},
        ),
    ]
    if usage is not None:
        chunks.append(_sse(None, {**head, "choices": [], "usage": usage}))
    chunks.append(b"data: [DONE]\n\n")
    return chunks


def anthropic_block(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input}


def anthropic_events(call: ToolCall, message: dict[str, Any], usage: dict[str, Any]) -> list[bytes]:
    """A streamed Anthropic message calling ``call`` (``message``: the ``message_start`` message)."""
    block = {"type": "tool_use", "id": call.id, "name": call.name, "input": {}}
    delta = {"type": "input_json_delta", "partial_json": call.arguments}
    return [
        _sse("message_start", {"type": "message_start", "message": message}),
        _sse("content_block_start", {"type": "content_block_start", "index": 0, "content_block": block}),
        _sse("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta}),
        _sse("content_block_stop", {"type": "content_block_stop", "index": 0}),
        _sse(
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                "usage": usage,
            },
        ),
        _sse("message_stop", {"type": "message_stop"}),
    ]


def responses_item(call: ToolCall, status: str = "completed") -> dict[str, Any]:
    return {
        "id": f"fc_{call.id}",
        "type": "function_call",
        "status": status,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if status == "completed" else "",
    }


def responses_events(call: ToolCall, started: dict[str, Any], final: dict[str, Any]) -> list[bytes]:
    """A streamed Responses answer calling ``call`` (``started``: the in-progress response,
    ``final``: the completed one)."""
    seq = iter(range(1 << 30))

    def event(kind: str, **fields: Any) -> bytes:
        return _sse(kind, {"type": kind, "sequence_number": next(seq), **fields})

    item_id = f"fc_{call.id}"
    return [
        event("response.created", response=started),
        event("response.in_progress", response=started),
        event("response.output_item.added", output_index=0, item=responses_item(call, "in_progress")),
        event(
            "response.function_call_arguments.delta", item_id=item_id, output_index=0, delta=call.arguments
        ),
        event(
            "response.function_call_arguments.done", item_id=item_id, output_index=0, arguments=call.arguments
        ),
        event("response.output_item.done", output_index=0, item=responses_item(call)),
        event("response.completed", response=final),
    ]
