"""Threads inside a session, on the request shapes recorded from the real CLIs (Claude Code 2.1.197
on ``/v1/messages``, Codex CLI 0.171.0 on ``/v1/responses``, opencode 1.18.33 on
``/v1/chat/completions``): headers, field layout and the side traffic each sends under its session
id. The texts are made up; the shapes are the CLIs'."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from bench.sim import SimRankServer
from proxy.server import ServerThread
from tests.helpers.gateway import start_gateway
from tests.helpers.ranks import RankServers

BASH = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}


@pytest.fixture
def proxy(rank_servers: RankServers) -> Iterator[ServerThread]:
    fleet: list[SimRankServer] = rank_servers.sim(2, kv_tokens=200_000)
    server = start_gateway(fleet)
    yield server
    server.stop()


def session_of(proxy: ServerThread, key: str) -> dict[str, Any]:
    response = httpx.get(f"{proxy.url}/admin/sessions/{key}", timeout=10)
    response.raise_for_status()
    return response.json()


def post(proxy: ServerThread, path: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    response = httpx.post(proxy.url + path, json=body, headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    return response


# -- opencode: a title generator first, then the conversation --------------------------------------
OPENCODE_SYSTEM = (
    "You are opencode, an interactive CLI tool for software engineering tasks.\n" + "Be brief. " * 80
)


def opencode_turn(history: list[dict[str, Any]]) -> dict[str, Any]:
    tools = [
        {"type": "function", "function": {"name": name, "description": name, "parameters": BASH}}
        for name in ("bash", "edit", "glob", "read")
    ]
    return {
        "model": "sim",
        "max_tokens": 8,
        "messages": [{"role": "system", "content": OPENCODE_SYSTEM}, *history],
        "tools": tools,
        "tool_choice": "auto",
    }


def test_opencode_title_generator_is_a_side_thread_not_a_break(proxy: ServerThread) -> None:
    headers = {"x-session-id": "ses_oc1", "x-session-affinity": "ses_oc1"}
    title = {
        "model": "sim",
        "max_tokens": 8,
        "messages": [
            {"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
            {"role": "user", "content": "Generate a title for this conversation:\n"},
            {"role": "user", "content": '"list the files"'},
        ],
    }
    post(proxy, "/v1/chat/completions", title, headers)
    history: list[dict[str, Any]] = [{"role": "user", "content": '"list the files"'}]
    for step in range(3):
        answer = post(proxy, "/v1/chat/completions", opencode_turn(history), headers).json()
        call = {
            "id": f"c{step}",
            "type": "function",
            "function": {"name": "bash", "arguments": '{"command": "ls"}'},
        }
        history += [
            {
                "role": "assistant",
                "content": answer["choices"][0]["message"]["content"],
                "tool_calls": [call],
            },
            {"role": "tool", "tool_call_id": f"c{step}", "content": "notes.txt\n"},
        ]
    # a second title request later in the session: still the side thread
    post(proxy, "/v1/chat/completions", title, headers)
    session = session_of(proxy, "ses_oc1")
    assert session["breaks"] == []
    kinds = {t["kind"]: t for t in session["threads"]}
    assert set(kinds) == {"main", "side"}
    assert kinds["main"]["requests"] == 3 and kinds["side"]["requests"] == 2
    assert kinds["side"]["label"].startswith("You are a title generator")
    assert kinds["main"]["hit_tokens_reported"] > 0
    # the dashboard's session detail lists them too
    detail = httpx.get(f"{proxy.url}/admin/overview/sessions/ses_oc1", timeout=10).json()
    assert [t["kind"] for t in detail["threads"]] == ["main", "side"]


def test_opencode_sub_agent_session_is_a_thread_of_its_parent(proxy: ServerThread) -> None:
    """opencode runs a sub-agent (its task tool) as a child session: its own session id, and the
    parent's in ``x-parent-session-id``. It is a thread of the parent's session, never a session of
    its own nor a break of the parent's conversation."""
    parent = {"x-session-id": "ses_par", "x-session-affinity": "ses_par"}
    child = {"x-session-id": "ses_kid", "x-session-affinity": "ses_kid", "x-parent-session-id": "ses_par"}
    history: list[dict[str, Any]] = [{"role": "user", "content": "list the files"}]
    child_history: list[dict[str, Any]] = [{"role": "user", "content": "find the tests"}]
    for step in range(3):
        for headers, turns in ((parent, history), (child, child_history)):
            answer = post(proxy, "/v1/chat/completions", opencode_turn(turns), headers).json()
            turns += [
                {"role": "assistant", "content": answer["choices"][0]["message"]["content"]},
                {"role": "user", "content": f"step {step}"},
            ]
    session = session_of(proxy, "ses_par")
    assert session["breaks"] == [] and session["turns"] == 6
    threads = {t["key"]: t for t in session["threads"]}
    assert set(threads) == {"main", "agent:ses_kid"}
    kid = threads["agent:ses_kid"]
    assert kid["kind"] == "subagent" and kid["parent"] == "main" and kid["requests"] == 3
    assert kid["source"] == "header:x-parent-session-id"
    assert threads["main"]["requests"] == 3
    assert httpx.get(f"{proxy.url}/admin/sessions/ses_kid", timeout=10).status_code == 404


# -- Claude Code: side checks without tools and a sub-agent under its session id --------------------
def claude_system(identity: str) -> list[dict[str, Any]]:
    return [
        {
            "type": "text",
            "text": "x-anthropic-billing-header: cc_version=2.1.197.8a5; cc_entrypoint=sdk-cli;",
        },
        {"type": "text", "text": identity, "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "Use the tools. " * 100, "cache_control": {"type": "ephemeral"}},
    ]


def claude_tools(*names: str) -> list[dict[str, Any]]:
    return [{"name": name, "description": f"The {name} tool.", "input_schema": BASH} for name in names]


def test_claude_code_side_checks_and_sub_agents_are_threads(proxy: ServerThread) -> None:
    headers = {"x-claude-code-session-id": "cc-1", "anthropic-version": "2023-06-01", "x-app": "cli"}
    messages: list[dict[str, Any]] = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "<system-reminder>ctx</system-reminder>"},
                {"type": "text", "text": "list the files"},
            ],
        },
    ]

    def main_turn() -> None:
        body = {
            "model": "claude-opus-4-8",
            "max_tokens": 8,
            "system": claude_system("You are a Claude agent, built on the Agent SDK."),
            "tools": claude_tools("Agent", "Bash", "Edit", "Read"),
            "messages": messages,
            "metadata": {"user_id": '{"session_id":"cc-1"}'},
            "stream": False,
        }
        answer = post(proxy, "/v1/messages", body, headers).json()
        messages.append({"role": "assistant", "content": answer["content"]})
        messages.append({"role": "user", "content": [{"type": "text", "text": "go on"}]})

    main_turn()
    # a small-model check: no tools, its own system prompt
    check = {
        "model": "claude-haiku-4-5",
        "max_tokens": 8,
        "system": [{"type": "text", "text": "Analyze if this message starts a new conversation topic."}],
        "messages": [{"role": "user", "content": "list the files"}],
    }
    post(proxy, "/v1/messages", check, headers)
    main_turn()
    # a sub-agent: another system prompt, its own conversation, its own tools
    agent = {
        "model": "claude-opus-4-8",
        "max_tokens": 8,
        "system": claude_system("You are an agent for Claude Code. Given the task, search the code."),
        "tools": claude_tools("Bash", "Read"),
        "messages": [{"role": "user", "content": "find where the tests live"}],
    }
    post(proxy, "/v1/messages", agent, headers)
    main_turn()
    session = session_of(proxy, "cc-1")
    assert session["breaks"] == []
    threads = session["threads"]
    assert [t["kind"] for t in threads] == ["main", "side", "subagent"]
    assert threads[0]["requests"] == 3 and threads[0]["label"].startswith("You are a Claude agent")
    assert threads[2]["label"].startswith("You are an agent for Claude Code")
    # the session's rank serves all its threads
    assert session["rank"] is not None


# -- Codex: one conversation, re-sent whole every turn (store: false) -------------------------------
def test_codex_session_is_one_thread(proxy: ServerThread) -> None:
    headers = {"session-id": "019a-codex", "thread-id": "019a-codex", "originator": "codex_exec"}
    tools = [
        {
            "type": "function",
            "name": "exec_command",
            "description": "Runs a command.",
            "parameters": BASH,
            "strict": False,
        },
    ]
    items: list[dict[str, Any]] = [
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "<environment_context>cwd</environment_context>"}],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]},
    ]
    for step in range(3):
        body = {
            "model": "gpt-5-codex",
            "instructions": "You are Codex, a coding agent. " * 60,
            "input": items,
            "tools": tools,
            "store": False,
            "stream": False,
            "prompt_cache_key": "019a-codex",
        }
        answer = post(proxy, "/v1/responses", body, headers).json()
        text = answer["output"][0]["content"][0]["text"]
        items = [
            *items,
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": f"step {step}"}]},
        ]
    session = session_of(proxy, "019a-codex")
    assert session["breaks"] == [] and session["turns"] == 3
    assert [t["kind"] for t in session["threads"]] == ["main"]
