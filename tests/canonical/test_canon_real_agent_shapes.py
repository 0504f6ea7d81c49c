"""tests/helpers/real_agent_shapes.py: sessions of real agents' prompts with their drift, on a folder
built here; and what the canonicalizer makes of them: every session's system + tools the same bytes again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson

from bench.agent_shapes import Shape
from proxy.canonical import CanonicalConfig, Canonicalizer, InMemorySessionCanonState
from tests.helpers.real_agent_shapes import RealAgents, agent_names

CLOCK_FIELD = {
    "name": "current_date_time",
    "file": "system_prompt.txt",
    "example": "2025-08-28 14:03:27",
    "regex": r"The current date is (\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})\.",
    "matches": 1,
}


def make_agent(root: Path) -> Path:
    folder = root / "agent"
    folder.mkdir()
    (folder / "system_prompt.txt").write_text("You are an agent.\nThe current date is 2025-08-28 14:03:27.\n")
    tools = []
    for i in range(5):
        props = {n: {"description": n, "type": "string"} for n in ("command", "cwd", "env", "timeout")}
        params = {"type": "object", "properties": props, "required": ["command", "cwd", "timeout"]}
        tools.append(
            {"type": "function", "function": {"name": f"t{i}", "description": "d", "parameters": params}}
        )
    (folder / "tools.json").write_text(json.dumps(tools))
    (folder / "volatile.json").write_text(json.dumps({"fields": [CLOCK_FIELD]}))
    return root


def head(body: dict[str, Any]) -> bytes:
    return orjson.dumps([[m for m in body["messages"] if m["role"] == "system"], body.get("tools")])


def param_orders(body: dict[str, Any]) -> list[list[str]]:
    return sorted(list(t["function"]["parameters"]["properties"]) for t in body["tools"])


def test_drift_per_session_and_none_without(tmp_path: Path) -> None:
    agents = RealAgents(Shape(first_user_tokens=20, step_tokens=20), folder=make_agent(tmp_path))
    assert agent_names(tmp_path) == ("agent",)
    calm = [agents.build("agent", s, 3, drift=False) for s in range(4)]
    assert len({head(turn) for session in calm for turn in session}) == 1
    drifting = [agents.build("agent", s, 3, drift=True) for s in range(4)]
    assert len({orjson.dumps(param_orders(s[0])) for s in drifting}) > 1  # parameter order per session
    for session in drifting:  # ... kept within the session
        assert len({orjson.dumps(param_orders(turn)) for turn in session}) == 1
        assert len({head(turn) for turn in session}) == len(session)  # attribution line per request


def test_canonical_heads_are_shared_by_every_session(tmp_path: Path) -> None:
    agents = RealAgents(Shape(first_user_tokens=20, step_tokens=20), folder=make_agent(tmp_path))
    canon = Canonicalizer(CanonicalConfig(), strict=True)
    heads = set()
    for s in range(4):
        state = InMemorySessionCanonState()
        for body in agents.build("agent", s, 3, drift=True):
            heads.add(head(canon.apply(body, api="chat", session=state).body))
    assert len(heads) == 1
    off = Canonicalizer(CanonicalConfig.model_validate({"rules": {"param_order": {"enabled": False}}}))
    first_turns = [agents.build("agent", s, 1, drift=True)[0] for s in range(4)]
    assert (
        len({head(off.apply(b, api="chat", session=InMemorySessionCanonState()).body) for b in first_turns})
        > 1
    )


def test_every_real_agents_sessions_share_their_canonical_head(shared_dir: Path) -> None:
    # issue 48's drift check on ../shared/agents: each session with its own parameter and tool order,
    # a per-turn reshuffle, its own clock and a per-request attribution line; canonicalized, every turn
    # of every session sends the same system + tools bytes, as sessions without drift do
    folder = shared_dir / "agents"
    agents = RealAgents(Shape(first_user_tokens=20, step_tokens=20), folder=folder)
    names = agent_names(folder)
    assert len(names) >= 6
    canon = Canonicalizer(CanonicalConfig(), strict=True)
    for name in names:
        heads = set()
        for s in range(4):
            state = InMemorySessionCanonState()
            for body in agents.build(name, s, 3, drift=True):
                heads.add(head(canon.apply(body, api="chat", session=state).body))
        assert len(heads) == 1, name
