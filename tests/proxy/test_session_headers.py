"""Sessions and sub-agents from the headers the current agent CLIs send (Claude Code 2.1.332, Codex CLI
0.171.0, opencode 1.18.33, read from their npm packages): each session header gives the session key,
a sub-agent header a thread of its parent's session, the precedence when several are present, and a
session whose headers stay the same is never split."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.datastructures import Headers

from proxy.apis import CHAT
from proxy.context import RequestContext
from proxy.ops.auth import ClientKey, digest
from proxy.stages.identify import DEFAULT_SESSION_HEADERS, PARENT_SESSION_HEADERS, Identify, Threads
from proxy.state.local import MAIN, SessionLocals

SESSION_HEADERS = ("x-session-id", "x-claude-code-session-id", "session-id", "x-session-affinity")
SESSION_HEADERS += ("x-opencode-session", "x-task-id")
TOOLS = [{"type": "function", "function": {"name": "bash", "parameters": {"type": "object"}}}]


def body(system: str = "You are an agent.", user: str = "go") -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return {"model": "m", "messages": messages, "tools": TOOLS}


class Stages:
    """Identify then Threads, as the pipeline runs them, over one process's session state."""

    def __init__(self) -> None:
        self.locals = SessionLocals()
        self.identify = Identify(self.locals)
        self.threads = Threads(self.locals)

    def run(
        self, headers: dict[str, str], payload: dict[str, Any] | None = None, client: str | None = None
    ) -> RequestContext:
        key = ClientKey(client, digest(client)) if client else None
        ctx = RequestContext(CHAT, Headers(headers), b"{}", payload or body(), False, "m", 0.0, client=key)
        self.identify(ctx)
        self.threads(ctx)
        return ctx


def where(ctx: RequestContext) -> tuple[str | None, str | None, str | None]:
    assert ctx.thread is not None
    return ctx.session_key, ctx.session_source, ctx.thread.key


@pytest.mark.parametrize("header", SESSION_HEADERS)
def test_each_session_header_gives_the_session_key(header: str) -> None:
    assert header in DEFAULT_SESSION_HEADERS
    stages = Stages()
    ctx = stages.run({header.upper(): "S-1"})  # header names are case-insensitive
    assert where(ctx) == ("S-1", f"header:{header}", MAIN)


def test_precedence_of_session_headers() -> None:
    stages = Stages()
    every = {h: f"id-{i}" for i, h in enumerate(DEFAULT_SESSION_HEADERS)}
    for first in range(len(DEFAULT_SESSION_HEADERS)):
        present = dict(list(every.items())[first:])
        ctx = stages.run(present)
        assert ctx.session_key == f"id-{first}", present
    # a session header beats the body's prompt_cache_key, which beats the fingerprint
    assert stages.run({"session-id": "h"}, {**body(), "prompt_cache_key": "b"}).session_key == "h"
    assert stages.run({}, {**body(), "prompt_cache_key": "b"}).session_key == "b"


def test_opencode_child_session_is_a_thread_of_its_parent() -> None:
    stages = Stages()
    parent = {"x-session-affinity": "ses_P", "x-session-id": "ses_P"}
    assert where(stages.run(parent)) == ("ses_P", "header:x-session-id", MAIN)
    child = {"x-session-affinity": "ses_C", "x-session-id": "ses_C", "x-parent-session-id": "ses_P"}
    ctx = stages.run(child, body("You are a sub-agent.", "search"))
    assert where(ctx) == ("ses_P", "header:x-parent-session-id", "agent:ses_C")
    assert ctx.thread is not None and ctx.thread.kind == "subagent" and ctx.thread.parent == MAIN
    # the child's child joins the root session too, its parent recorded
    grandchild = {"x-session-id": "ses_G", "x-parent-session-id": "ses_C"}
    ctx = stages.run(grandchild, body("You are a sub-agent.", "read"))
    assert where(ctx) == ("ses_P", "header:x-parent-session-id", "agent:ses_G")
    assert ctx.thread is not None and ctx.thread.parent == "agent:ses_C"
    session = stages.locals.open("ses_P")
    assert set(session.threads) == {MAIN, "agent:ses_C", "agent:ses_G"}
    assert PARENT_SESSION_HEADERS == ("x-parent-session-id",)


def test_claude_code_sub_agents_and_their_parents() -> None:
    stages = Stages()
    session = {"X-Claude-Code-Session-Id": "cc-1"}
    assert where(stages.run(session)) == ("cc-1", "header:x-claude-code-session-id", MAIN)
    agent = {**session, "x-claude-code-agent-id": "a1"}
    ctx = stages.run(agent, body("You are an agent for Claude Code.", "find"))
    assert where(ctx)[2] == "agent:a1" and ctx.thread is not None and ctx.thread.parent == MAIN
    nested = {**session, "x-claude-code-agent-id": "a2", "x-claude-code-parent-agent-id": "a1"}
    ctx = stages.run(nested, body("You are an agent for Claude Code.", "look"))
    assert where(ctx) == ("cc-1", "header:x-claude-code-session-id", "agent:a2")
    assert ctx.thread is not None and ctx.thread.source == "header:x-claude-code-agent-id"
    assert ctx.thread.parent == "agent:a1"


def test_claude_code_memory_extraction_is_a_side_thread() -> None:
    """Claude Code marks its memory extraction with ``x-claude-code-auxiliary-type``: a side request
    even though it offers tools under the main thread's system prompt (which would be the main one)."""
    stages = Stages()
    session = {"X-Claude-Code-Session-Id": "cc-2"}
    assert where(stages.run(session))[2] == MAIN
    ctx = stages.run({**session, "x-claude-code-auxiliary-type": "memory_save"})
    assert ctx.thread is not None and ctx.thread.kind == "side" and ctx.thread.key != MAIN
    assert ctx.thread.source == "header:x-claude-code-auxiliary-type"
    assert where(stages.run(session))[2] == MAIN


def test_codex_sub_agent_threads() -> None:
    stages = Stages()
    main = {"session-id": "019a", "thread-id": "019a"}
    assert where(stages.run(main)) == ("019a", "header:session-id", MAIN)
    spawn = {"session-id": "019a", "thread-id": "019b", "x-codex-parent-thread-id": "019a"}
    spawn["x-openai-subagent"] = "collab_spawn"
    ctx = stages.run(spawn, body("You are a sub-agent.", "review"))
    assert where(ctx) == ("019a", "header:session-id", "agent:019b")
    assert ctx.thread is not None and ctx.thread.parent == MAIN


def test_own_thread_id_is_the_main_thread_with_client_keys() -> None:
    """With client keys the session key is namespaced; Codex's thread-id equal to its session-id is
    still the session's own id, not a sub-agent."""
    stages = Stages()
    ctx = stages.run({"session-id": "019a", "thread-id": "019a"}, client="team")
    assert ctx.session_key != "019a" and where(ctx)[2] == MAIN
    other = stages.run({"session-id": "019a", "thread-id": "019a"}, client="other")
    assert other.session_key != ctx.session_key  # one client never continues another's session


def test_a_child_session_cannot_join_another_clients_session() -> None:
    stages = Stages()
    stages.run({"x-session-id": "P"}, client="a")
    stages.run({"x-session-id": "C", "x-parent-session-id": "P"}, client="a")
    ctx = stages.run({"x-session-id": "G", "x-parent-session-id": "C"}, client="b")
    own = stages.run({"x-session-id": "P"}, client="b")
    assert ctx.session_key != stages.run({"x-session-id": "P"}, client="a").session_key
    assert ctx.session_key != own.session_key  # b's "C" is its own, not a's child of P


def test_no_false_breaks_a_session_whose_headers_stay_is_never_split() -> None:
    """Each agent's requests over many turns, side requests, sub-agents and parents seen in any order:
    the same headers always land in the same session and thread."""
    stages = Stages()
    requests = [
        {"x-session-id": "ses_G", "x-parent-session-id": "ses_C"},  # before its parent was seen
        {"x-session-id": "ses_P"},
        {"x-session-id": "ses_C", "x-parent-session-id": "ses_P"},
        {"X-Claude-Code-Session-Id": "cc"},
        {"X-Claude-Code-Session-Id": "cc", "x-claude-code-agent-id": "a1"},
        {"session-id": "cx", "thread-id": "cx"},
        {"session-id": "cx", "thread-id": "cy", "x-codex-parent-thread-id": "cx"},
    ]
    first: dict[int, tuple[str | None, str | None, str | None]] = {}
    for turn in range(6):
        numbered = list(enumerate(requests))
        for i, headers in numbered if turn % 2 else numbered[::-1]:
            got = where(stages.run(headers, body(f"You are agent {i}.")))
            assert first.setdefault(i, got) == got, (turn, headers)


def test_an_end_of_session_header_ends_the_session_but_not_from_a_sub_agent() -> None:
    stages = Stages()
    child = stages.run(
        {"x-session-id": "helper", "x-parent-session-id": "root", "x-dynamo-session-final": "true"}
    )
    assert child.session_thread == "helper" and not child.session_ends  # the parent's seat stays
    last = stages.run({"x-session-id": "root", "x-prefixgate-session-end": "TRUE"})
    assert last.session_thread is None and last.session_ends
    assert not stages.run({"x-session-id": "root", "x-dynamo-session-final": "no"}).session_ends
