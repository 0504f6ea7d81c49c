"""``late_system``: system messages an agent sends mid-conversation stay where it put them.

The requests here have the shape of Claude Code 2.1.332's (synthetic text of the same structure): the
system prompt in ``system`` text blocks (billing line, identity line, the prompt with a ``# Memory``
section naming a per-directory path), then a first user message, then a ``system``-role message with
an environment list naming the working directory, a token budget and the date, and after every tool
round another ``system``-role message with a new token budget. vLLM's Anthropic entrypoint appends
every system-role message's text to the system prompt (``tokenization.chat_conversion``), which made
the system prompt differ per directory and grow on every turn.
"""

from __future__ import annotations

import copy
from itertools import pairwise
from typing import Any

import pytest

from proxy.apis.base import SLOT
from proxy.apis.messages import MESSAGES
from proxy.canonical import CanonicalConfig, Canonicalizer, InMemorySessionCanonState
from proxy.canonical.rules.late_system import NAME, SLOT_KEY
from tokenization.chat_conversion import anthropic_to_chat

PROMPT = (
    "You are a coding agent.\n\n# Harness\n - Text you write is shown to the user.\n\n# Memory\n\n"
    "You have a persistent file-based memory at `{home}/.claude/projects/{slug}/memory/`. Write to it "
    "directly.\n\n```markdown\n---\nname: <slug>\n---\n```\n\nKeep one fact per file.\n\n"
    "# Environment\n - Newer models exist.\n\n# Context management\nLong conversations are summarized."
)
LATE_ENV = (
    "# Environment\nYou have been invoked in the following environment: \n"
    " - Primary working directory: {cwd}\n - Is a git repository: true\n - Platform: linux\n"
    " - Shell: bash\n\nYou are powered by the model named Test 1.\n\nDeferred tools:\nCronCreate\n"
    "WebFetch\n\nAvailable agent types:\n- general: any task.\n\n"
    "<total_tokens>15000000 tokens left</total_tokens>\n\nToday's date is 2026-12-06."
)


def budget(left: int) -> str:
    return f"<total_tokens>{left} tokens left</total_tokens>"


def tool(name: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}
    return {"name": name, "description": f"Runs {name}.", "input_schema": schema}


def marked(text: str) -> list[dict[str, Any]]:
    """One text block carrying a cache breakpoint, as the agent sends its newest message."""
    return [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]


def turns(n: int, directory: str) -> list[dict[str, Any]]:
    """The first ``n`` requests of a session in ``directory``: each adds a tool round and a budget."""
    home = f"/tmp/{directory}/home"
    cwd = f"/tmp/{directory}/work"
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=9.9.9.abc; cc_entrypoint=sdk-cli;"},
        {"type": "text", "text": "You are a test agent.", "cache_control": {"type": "ephemeral"}},
        {
            "type": "text",
            "text": PROMPT.format(home=home, slug="-" + cwd.strip("/").replace("/", "-")),
            "cache_control": {"type": "ephemeral"},
        },
    ]
    first = {
        "role": "user",
        "content": [
            {"type": "text", "text": "<system-reminder>\nContext: branch main.\n</system-reminder>"},
            {"type": "text", "text": "List the files."},
        ],
    }
    out = []
    history: list[dict[str, Any]] = [first, {"role": "system", "content": LATE_ENV.format(cwd=cwd)}]
    for k in range(n):
        messages = copy.deepcopy(history)
        last = messages[-1]
        if isinstance(last["content"], str):  # the newest message carries the breakpoint
            last["content"] = marked(last["content"])
        body = {"model": "m", "max_tokens": 8, "system": system, "tools": [tool("Bash")]}
        out.append({**body, "messages": messages})
        call = f"call_{k}"
        history += [
            {"role": "assistant", "content": [{"type": "tool_use", "id": call, "name": "Bash", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call, "content": "a.txt"}]},
            {"role": "system", "content": budget(14_990_000 - k)},
        ]
    return out


def canonical(
    body: dict[str, Any], canon: Canonicalizer, session: InMemorySessionCanonState
) -> dict[str, Any]:
    """``body`` through the Messages API's canonicalization view, as the pipeline runs it."""
    view = MESSAGES.canon_view(body)
    assert view is not None
    result = canon.apply(view, api="chat", session=session)
    return MESSAGES.from_canon_view(body, view, result.body) if result.changed else body


def rendered(body: dict[str, Any]) -> tuple[str, list[Any], list[Any]]:
    """What the rank renders: (system text, tools, the other chat messages)."""
    chat = anthropic_to_chat(body)
    messages = chat["messages"]
    assert messages[0]["role"] == "system"
    return messages[0]["content"], chat["tools"], messages[1:]


def default() -> Canonicalizer:
    return Canonicalizer(CanonicalConfig(), strict=True)


def test_the_slot_key_is_the_one_the_apis_mark() -> None:
    assert SLOT_KEY == SLOT


def test_without_the_rule_the_system_prompt_drifts_per_directory_and_grows_per_turn() -> None:
    """The shape's problem, as the rank would see it with the rule off."""
    canon = Canonicalizer(CanonicalConfig.model_validate({"rules": {NAME: {"enabled": False}}}), strict=True)
    a = [rendered(canonical(b, canon, InMemorySessionCanonState()))[0] for b in turns(3, "a")]
    b = rendered(canonical(turns(1, "b")[0], canon, InMemorySessionCanonState()))[0]
    assert a[0] != b and "/tmp/a/work" in a[0]
    assert len(a[0]) < len(a[1]) < len(a[2]) and budget(14_990_000) in a[1]


def test_late_system_messages_become_user_messages_in_place_byte_for_byte() -> None:
    body = turns(2, "a")[1]
    # the memory section pinned to the newest user message aside (test_canon_agent_sections)
    memory_off = CanonicalConfig.model_validate({"rules": {"claude_memory": {"enabled": False}}})
    out = canonical(body, Canonicalizer(memory_off, strict=True), InMemorySessionCanonState())
    assert [m["role"] for m in out["messages"]] == ["user", "user", "assistant", "user", "user"]
    for before, after in zip(body["messages"], out["messages"], strict=True):
        assert {**after, "role": None} == {**before, "role": None}
    assert out["messages"][4]["content"] == marked(budget(14_990_000))  # the breakpoint rides along
    assert out["system"] == body["system"][1:]  # the billing line is attribution_line's
    assert body["messages"][1]["role"] == "system"  # the client's body is not changed in place


def test_sessions_in_other_directories_share_system_and_tools() -> None:
    views = [rendered(canonical(turns(1, d)[0], default(), InMemorySessionCanonState())) for d in "abc"]
    assert len({system for system, _, _ in views}) == 1
    assert len({repr(tools) for _, tools, _ in views}) == 1
    system = views[0][0]
    assert "/tmp/" not in system and "<total_tokens>" not in system and "# Context management" in system
    # what left the system prompt is in the conversation, in the order the agent sent it
    texts = [repr(m["content"]) for m in views[0][2]]
    assert "Primary working directory: /tmp/a/work" in texts[1]
    assert "/tmp/a/home/.claude/projects/-tmp-a-work/memory/" in "".join(texts)


def test_every_turn_extends_the_previous_one_as_the_rank_renders_it() -> None:
    canon, session = default(), InMemorySessionCanonState()
    views = [rendered(canonical(b, canon, session)) for b in turns(4, "a")]
    assert len({(system, repr(tools)) for system, tools, _ in views}) == 1
    for (_, _, old), (_, _, new) in pairwise(views):
        assert new[: len(old)] == old
        assert len(new) == len(old) + 3  # the tool call, its result, the budget


def test_a_request_of_another_api_keeps_its_late_system_messages() -> None:
    """Chat templates render a late system message where it stands: nothing to do there."""
    messages = [
        {"role": "system", "content": "You help."},
        {"role": "user", "content": "hi"},
        {"role": "system", "content": budget(5)},
    ]
    result = default().apply({"model": "m", "messages": messages}, api="chat")
    assert not result.changed or result.body["messages"][2] == messages[2]


@pytest.mark.parametrize("settings", [{"enabled": False}, {"hoisting_fields": []}])
def test_off_leaves_them_to_the_rank(settings: dict[str, Any]) -> None:
    canon = Canonicalizer(CanonicalConfig.model_validate({"rules": {NAME: settings}}), strict=True)
    out = canonical(turns(2, "a")[1], canon, InMemorySessionCanonState())
    assert [m["role"] for m in out["messages"]] == ["user", "system", "assistant", "user", "system"]


def test_counted_under_its_name_and_other_messages_kept_as_they_are() -> None:
    body = turns(3, "a")[2]
    view = MESSAGES.canon_view(body)
    assert view is not None
    result = default().apply(view, api="chat", session=InMemorySessionCanonState())
    assert result.rewrites[NAME] == 3
    kept = [m for m in result.body["messages"][1:] if m.get("role") == "assistant"]
    assert all(any(m is v for v in view["messages"]) for m in kept)
