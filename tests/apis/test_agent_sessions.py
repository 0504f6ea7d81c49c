"""Claude-Code- and Codex-shaped sessions reach the hit rate of the same session over chat completions."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx

TURNS = 6
SYSTEM = "You are an interactive CLI tool that helps users with software engineering tasks. " * 25
BILLING = "x-anthropic-billing-header: cc_version=2.1.37.{v}; cc_entrypoint=cli; cch={cch};"
SCHEMAS = {
    "Read": {"type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]},
    "Bash": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
}


def task(turn: int) -> str:
    return f"Turn {turn}: look at module_{turn}.py and make its tests pass. " * 8


def billing(turn: int) -> str:
    """Claude Code's billing line, which changes every turn."""
    return BILLING.format(v=f"a{turn}f", cch=f"{turn * 7919:05x}")


def hit_rate(usages: list[tuple[int, int]]) -> float:
    """Cached over prompt tokens, turns after the first."""
    later = usages[1:]
    return sum(c for c, _ in later) / sum(p for _, p in later)


# -- Claude Code: Anthropic Messages ------------------------------------------------------------------
def claude_code_session(url: str, session: str) -> list[tuple[int, int]]:
    tools = [{"name": n, "description": f"The {n} tool.", "input_schema": s} for n, s in SCHEMAS.items()]
    messages: list[dict[str, Any]] = []
    usages = []
    with httpx.Client(timeout=30) as client:
        for turn in range(TURNS):
            for m in messages:  # Claude Code moves its cache_control marker to the newest message
                for block in m["content"]:
                    block.pop("cache_control", None)
            messages.append({"role": "user", "content": [{"type": "text", "text": task(turn)}]})
            messages[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
            system = [
                {"type": "text", "text": billing(turn)},
                {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}},
            ]
            body = {"model": "sim", "max_tokens": 12, "system": system, "tools": tools, "messages": messages}
            answer = client.post(
                url + "/v1/messages", json=body, headers={"x-claude-code-session-id": session}
            )
            assert answer.status_code == 200, answer.text
            data = answer.json()
            usage = data["usage"]
            cached = usage["cache_read_input_tokens"]
            usages.append((cached, usage["input_tokens"] + cached + usage["cache_creation_input_tokens"]))
            call = {"type": "tool_use", "id": f"toolu_{turn}", "name": "Bash", "input": {"command": "pytest"}}
            messages.append(
                {"role": "assistant", "content": [{"type": "text", "text": data["content"][0]["text"]}, call]}
            )
            result = {"type": "tool_result", "tool_use_id": f"toolu_{turn}", "content": f"{turn} passed"}
            messages.append({"role": "user", "content": [result]})
    return usages


def chat_session(
    url: str, session: str, head: Callable[[int], list[dict[str, Any]]], call_id: str, arguments: str
) -> list[tuple[int, int]]:
    """An agent session over chat completions: ``head(turn)`` leads each prompt, then the turns so
    far, each answered with one ``Bash`` call (id ``{call_id}_{turn}``) and its result."""
    tools = [
        {"type": "function", "function": {"name": n, "description": f"The {n} tool.", "parameters": s}}
        for n, s in SCHEMAS.items()
    ]
    messages: list[dict[str, Any]] = []
    usages = []
    with httpx.Client(timeout=30) as client:
        for turn in range(TURNS):
            messages.append({"role": "user", "content": task(turn)})
            body = {"model": "sim", "max_tokens": 12, "messages": [*head(turn), *messages], "tools": tools}
            answer = client.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": session})
            assert answer.status_code == 200, answer.text
            data = answer.json()
            usage = data["usage"]
            usages.append((usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]))
            tool_id = f"{call_id}_{turn}"
            call = {"id": tool_id, "type": "function", "function": {"name": "Bash", "arguments": arguments}}
            messages.append(
                {
                    "role": "assistant",
                    "content": data["choices"][0]["message"]["content"],
                    "tool_calls": [call],
                }
            )
            messages.append({"role": "tool", "tool_call_id": tool_id, "content": f"{turn} passed"})
    return usages


def chat_session_like_claude_code(url: str, session: str) -> list[tuple[int, int]]:
    def head(turn: int) -> list[dict[str, Any]]:
        return [{"role": "system", "content": billing(turn) + "\n" + SYSTEM}]

    return chat_session(url, session, head, "toolu", json.dumps({"command": "pytest"}))


def test_claude_code_session_hits_like_chat(rank_servers, gateway):
    messages_rate = hit_rate(claude_code_session(gateway(rank_servers.sim(2)).url, "cc-1"))
    chat_rate = hit_rate(chat_session_like_claude_code(gateway(rank_servers.sim(2)).url, "chat-1"))
    assert messages_rate > 0.75
    assert abs(messages_rate - chat_rate) < 0.02, (messages_rate, chat_rate)


# -- Codex: OpenAI Responses --------------------------------------------------------------------------
INSTRUCTIONS = "You are Codex, based on GPT-5. You are running as a coding agent in the Codex CLI. " * 25
ENV = (
    "<environment_context>\n  <cwd>/home/dev/project</cwd>\n  <approval_policy>on-request</approval_policy>\n"
    "  <sandbox_mode>workspace-write</sandbox_mode>\n  <shell>bash</shell>\n</environment_context>"
)


def codex_session(url: str, session: str) -> list[tuple[int, int]]:
    tools = [
        {"type": "function", "name": n, "description": f"The {n} tool.", "parameters": s, "strict": False}
        for n, s in SCHEMAS.items()
    ]
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ENV}]}
    ]
    usages = []
    with httpx.Client(timeout=30) as client:
        for turn in range(TURNS):
            items.append(
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": task(turn)}]}
            )
            body = {
                "model": "sim",
                "instructions": INSTRUCTIONS,
                "input": items,
                "tools": tools,
                "store": False,
                "prompt_cache_key": session,
                "max_output_tokens": 12,
            }
            answer = client.post(url + "/v1/responses", json=body)
            assert answer.status_code == 200, answer.text
            data = answer.json()
            usage = data["usage"]
            usages.append((usage["input_tokens_details"]["cached_tokens"], usage["input_tokens"]))
            text = data["output"][0]["content"][0]["text"]
            items.append(
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
            )
            items.append(
                {
                    "type": "function_call",
                    "call_id": f"call_{turn}",
                    "name": "Bash",
                    "arguments": '{"command":"pytest"}',
                }
            )
            items.append(
                {"type": "function_call_output", "call_id": f"call_{turn}", "output": f"{turn} passed"}
            )
    return usages


def chat_session_like_codex(url: str, session: str) -> list[tuple[int, int]]:
    head = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": ENV}]
    return chat_session(url, session, lambda _turn: head, "call", '{"command":"pytest"}')


def test_codex_session_hits_like_chat(rank_servers, gateway):
    responses_rate = hit_rate(codex_session(gateway(rank_servers.sim(2)).url, "codex-1"))
    chat_rate = hit_rate(chat_session_like_codex(gateway(rank_servers.sim(2)).url, "chat-2"))
    assert responses_rate > 0.75
    assert abs(responses_rate - chat_rate) < 0.02, (responses_rate, chat_rate)


def test_predictions_are_exact_for_both_apis(rank_servers, gateway):
    """The proxy's conversion and the rank's agree token for token: estimated == reported hits."""
    proxy = gateway(rank_servers.sim(2))
    with httpx.Client(timeout=30) as client:
        for _ in range(2):
            body = {
                "model": "sim",
                "max_tokens": 4,
                "system": [{"type": "text", "text": SYSTEM}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": task(1)}]}],
            }
            answer = client.post(
                proxy.url + "/v1/messages", json=body, headers={"x-claude-code-session-id": "p"}
            )
            estimate = int(answer.headers["x-prefixgate-estimated-cached-tokens"])
            assert estimate == answer.json()["usage"]["cache_read_input_tokens"]
        for _ in range(2):
            body = {"model": "sim", "instructions": INSTRUCTIONS, "input": task(2), "max_output_tokens": 4}
            answer = client.post(proxy.url + "/v1/responses", json=body, headers={"session-id": "q"})
            estimate = int(answer.headers["x-prefixgate-estimated-cached-tokens"])
            assert estimate == answer.json()["usage"]["input_tokens_details"]["cached_tokens"]
    assert estimate > 0
