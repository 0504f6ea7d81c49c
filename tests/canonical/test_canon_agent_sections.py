"""The rules moving today's agents' volatile sections (Claude Code's ``gitStatus``, ``# Environment``
and ``# Memory``, opencode's ``<env>``) out of the system prompt, on request shapes recorded from the
real CLIs (Claude Code 2.1.197, opencode 1.18.33); the texts around the sections are made up."""

from __future__ import annotations

from typing import Any

from proxy.canonical import CanonicalConfig, Canonicalizer, InMemorySessionCanonState
from tokenization.tiktoken_tokenizer import render_segments

PROSE = "You help with code.\n\n# Doing tasks\n - Read before you edit.\n"


def git_status(status: str) -> str:
    return (
        "gitStatus: This is the git status at the start of the conversation. Note that this status is a "
        "snapshot in time, and will not update during the conversation.\n\nCurrent branch: master\n\n"
        f"Main branch (you will usually use this for PRs): main\n\nStatus:\n{status}\n\n"
        "Recent commits:\nd12ceae init"
    )


def environment(cwd: str) -> str:
    return (
        "# Environment\nYou have been invoked in the following environment: \n"
        f" - Primary working directory: {cwd}\n - Is a git repository: true\n - Platform: linux\n"
    )


def memory(cwd: str) -> str:
    dashed = cwd.replace("/", "-")
    return (
        "# Memory\n\nYou have a persistent file-based memory at "
        f"`/home/u/.claude/projects/{dashed}/memory/`. "
        "Write to it directly.\n\n```markdown\n---\nname: slug\n# not a heading inside the fence\n---\n```\n"
    )


def claude_system(cwd: str, status: str) -> str:
    return (
        PROSE
        + "\n"
        + memory(cwd)
        + "\n"
        + environment(cwd)
        + "\n# Context management\nAct.\n\n"
        + git_status(status)
    )


def claude_request(cwd: str, status: str, *turns: str) -> dict[str, Any]:
    """A Claude Code request: billing block, identity block, the big block; then the conversation."""
    system = [
        {
            "type": "text",
            "text": "x-anthropic-billing-header: cc_version=2.1.197.8a5; cc_entrypoint=sdk-cli;",
        },
        {"type": "text", "text": "You are a Claude agent.", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": claude_system(cwd, status), "cache_control": {"type": "ephemeral"}},
    ]
    messages: list[dict[str, Any]] = []
    for i, text in enumerate(turns):
        if i:
            messages.append({"role": "assistant", "content": [{"type": "text", "text": f"answer {i}"}]})
        messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
    tools = [{"type": "function", "function": {"name": "Bash", "parameters": {"type": "object"}}}]
    return {"messages": [{"role": "system", "content": system}, *messages], "tools": tools}


def canonicalizer(rules: dict[str, Any] | None = None) -> Canonicalizer:
    return Canonicalizer(CanonicalConfig.model_validate({"rules": rules or {}}), strict=True)


def system_of(body: dict[str, Any]) -> str:
    return "".join(part["text"] for part in body["messages"][0]["content"])


def test_git_status_and_environment_move_by_default() -> None:
    rules = {"claude_memory": {"enabled": False}}
    out = canonicalizer(rules).apply(claude_request("/w/a", "(clean)", "list the files"), api="chat")
    system = system_of(out.body)
    assert "gitStatus:" not in system and "# Environment" not in system
    assert "# Memory" in system  # switched off here
    assert system.endswith("# Context management\nAct.")
    user = out.body["messages"][1]["content"]
    # the sections in the order of the rules (whitespace hygiene has run: no trailing space), each
    # after a blank line in the message's last text part; attaching counts as a rewrite of the first
    listed = environment("/w/a").replace(": \n", ":\n").strip()
    assert user == [{"type": "text", "text": "list the files\n\n" + git_status("(clean)") + "\n\n" + listed}]
    assert out.rewrites["claude_git_status"] == 2 and out.rewrites["claude_environment"] == 1

    moved = canonicalizer().apply(claude_request("/w/a", "(clean)", "x"), api="chat").body
    assert "# Memory" not in system_of(moved) and "not a heading inside the fence" not in system_of(moved)
    assert memory("/w/a").strip() in moved["messages"][1]["content"][0]["text"]


def test_sessions_in_other_directories_share_system_and_tools() -> None:
    canon = canonicalizer()
    a = canon.apply(claude_request("/w/a", "(clean)", "x"), api="chat", session=InMemorySessionCanonState())
    b = canon.apply(claude_request("/w/b", "M x.py", "y"), api="chat", session=InMemorySessionCanonState())
    assert a.body["messages"][0] == b.body["messages"][0] and a.body["tools"] == b.body["tools"]


def test_a_new_git_status_goes_to_the_newest_user_message_and_the_history_stays() -> None:
    canon = canonicalizer()
    session = InMemorySessionCanonState()
    first = canon.apply(claude_request("/w/a", "(clean)", "one"), api="chat", session=session).body
    # a new process after a file edit (--continue): same history, a new status, a new prompt
    later = canon.apply(claude_request("/w/a", "M notes.txt", "one", "two"), api="chat", session=session).body
    assert later["messages"][:2] == first["messages"][:2]  # system and the first turn byte-identical
    newest = later["messages"][-1]["content"]
    # only the section that changed is attached anew
    assert newest == [{"type": "text", "text": "two\n\n" + git_status("M notes.txt")}]
    again = canon.apply(later, api="chat", session=session)
    assert again.body == later  # idempotent


def test_a_message_sent_as_parts_then_as_a_string_renders_alike() -> None:
    """Claude Code sends a user message as text parts (with a cache marker), later as a string."""
    canon = canonicalizer()
    session = InMemorySessionCanonState()
    first = canon.apply(claude_request("/w/a", "(clean)", "one"), api="chat", session=session).body
    later_request = claude_request("/w/a", "(clean)", "one", "two")
    later_request["messages"][1]["content"] = "one"  # the same message, as a string now
    later = canon.apply(later_request, api="chat", session=session).body
    rendered = render_segments(first["messages"], first["tools"], add_generation_prompt=False)
    again = render_segments(later["messages"], later["tools"], add_generation_prompt=False)
    assert again[: len(rendered)] == rendered


def test_opencode_env_block() -> None:
    env = (
        "Here is some useful information about the environment you are running in:\n<env>\n"
        "  Working directory: /w/a\n  Workspace root folder: /\n  Is directory a git repo: no\n"
        "  Platform: linux\n  Today's date: Tue Dec 01 2026\n</env>\n"
    )
    system = (
        "You are opencode.\n\nYou are powered by the model named m.\n"
        + env
        + "Skills provide instructions.\n"
    )
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": '"list"'}]}
    out = canonicalizer().apply(body, api="chat").body
    assert out["messages"][0]["content"] == (
        "You are opencode.\n\nYou are powered by the model named m.\nSkills provide instructions.\n"
    )
    assert out["messages"][1]["content"] == '"list"\n\n' + env.strip()
    off = canonicalizer({"opencode_env": {"versions": []}}).apply(body, api="chat")
    assert off.body["messages"][0]["content"] == system


def test_a_section_inside_a_fence_is_left_alone() -> None:
    text = "Example:\n```\n" + git_status("(clean)") + "\n```\n"
    body = {"messages": [{"role": "system", "content": text}, {"role": "user", "content": "u"}]}
    assert canonicalizer().apply(body, api="chat").body["messages"][0]["content"] == text
