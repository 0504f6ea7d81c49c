"""Agent-shaped sequences (tests/data/agents) and the real agent prompts (../shared/agents).

The point of canonicalization, checked on the rendered prompt: each turn's canonical prompt is a
byte prefix of the next turn's, except where the agent really changed something (tools added, a new
day in ``day`` mode), while the raw turns break where the agent drifts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.canonical import CanonicalConfig, Canonicalizer, InMemorySessionCanonState
from proxy.canonical.rules.text import protected_line_mask
from tokenization.tiktoken_tokenizer import render_segments

DATA = Path(__file__).resolve().parents[1] / "data" / "agents"
AGENTS = ("codex", "claude_code", "cline", "opencode", "openhands", "aider")
MOVE = {"rules": {"volatile_date": {"mode": "move"}}}

# agent -> (raw breaks, canonical breaks in day mode, canonical breaks in move mode): turn indices i
# where turn i-1's rendered prompt is not a prefix of turn i's.
EXPECTED: dict[str, tuple[set[int], set[int], set[int]]] = {
    "codex": ({1, 2, 3, 4}, set(), set()),
    "claude_code": ({1, 2, 3, 4}, {2}, {2}),  # turn 2: an MCP server connects (new tools)
    "cline": ({3}, set(), set()),
    "opencode": ({2, 3}, {3}, set()),  # turn 3: a new day
    "openhands": ({2}, set(), set()),
    "aider": ({2}, {2}, set()),
}


def load(agent: str) -> dict[str, Any]:
    return json.loads((DATA / f"{agent}.json").read_text(encoding="utf-8"))


def segments(turn: dict[str, Any]) -> list[str]:
    return render_segments(turn["messages"], turn.get("tools"), add_generation_prompt=False)


def breaks(turns: list[dict[str, Any]]) -> set[int]:
    out = set()
    for i in range(1, len(turns)):
        prev, cur = segments(turns[i - 1]), segments(turns[i])
        if cur[: len(prev)] != prev:
            out.add(i)
    return out


def run_session(agent: str, config: dict[str, Any]) -> list[dict[str, Any]]:
    canon = Canonicalizer(CanonicalConfig.model_validate(config), strict=True)
    state = InMemorySessionCanonState()
    return [
        canon.apply(t, api="chat", session=state, model=t.get("model")).body for t in load(agent)["turns"]
    ]


@pytest.mark.parametrize("agent", AGENTS)
def test_fixture_shape(agent: str) -> None:
    data = load(agent)
    assert data["agent"] == agent and data["drift"] and len(data["turns"]) >= 4
    for turn in data["turns"]:
        assert turn["messages"][0]["role"] == "system"


@pytest.mark.parametrize("agent", AGENTS)
def test_raw_turns_break_where_the_agent_drifts(agent: str) -> None:
    assert breaks(load(agent)["turns"]) == EXPECTED[agent][0]


@pytest.mark.parametrize("agent", AGENTS)
def test_canonical_turns_keep_their_prefix_day_mode(agent: str) -> None:
    assert breaks(run_session(agent, {})) == EXPECTED[agent][1]


@pytest.mark.parametrize("agent", AGENTS)
def test_canonical_turns_keep_their_prefix_move_mode(agent: str) -> None:
    assert breaks(run_session(agent, MOVE)) == EXPECTED[agent][2]


@pytest.mark.parametrize("agent", AGENTS)
@pytest.mark.parametrize(
    "config", [{}, MOVE, {"rules": {"env_block": {"enabled": True}, "volatile_date": {"mode": "move"}}}]
)
def test_idempotent_on_every_turn(agent: str, config: dict[str, Any]) -> None:
    canon = Canonicalizer(CanonicalConfig.model_validate(config), strict=True)
    state = InMemorySessionCanonState()
    for turn in load(agent)["turns"]:
        once = canon.apply(turn, api="chat", session=state).body
        twice = canon.apply(once, api="chat", session=state).body
        assert orjson.dumps(twice) == orjson.dumps(once)
        fresh = Canonicalizer(CanonicalConfig.model_validate(config), strict=True).apply(once, api="chat")
        assert orjson.dumps(fresh.body) == orjson.dumps(once) or fresh.rewrites.keys() <= {"tool_order"}


def test_user_side_volatile_content_is_left_alone() -> None:
    raw, canon = load("cline")["turns"][-1], run_session("cline", {})[-1]
    assert raw["messages"][1:] == canon["messages"][1:]  # Cline's per-turn clock lives in user messages
    texts = [p["text"] for m in canon["messages"] if isinstance(m["content"], list) for p in m["content"]]
    assert any("# Current Time\n11/3/2025, 9:15:48 AM" in t for t in texts)


def test_sessions_of_one_agent_share_system_and_tools_with_sort_mode() -> None:
    codex = load("codex")["turns"]
    config = CanonicalConfig.model_validate({"rules": {"tool_order": {"mode": "sort"}}})
    a = (
        Canonicalizer(config, strict=True)
        .apply(codex[1], api="chat", session=InMemorySessionCanonState())
        .body
    )
    b = (
        Canonicalizer(config, strict=True)
        .apply(codex[3], api="chat", session=InMemorySessionCanonState())
        .body
    )
    assert segments(a)[0] == segments(b)[0]


# --- the real agents' prompts ---------------------------------------------------------------------------
REAL = ("codex", "opencode", "openhands", "goose", "cline", "cline-xml")


def real_request(folder: Path) -> dict[str, Any]:
    if (folder / "system_messages.json").exists():
        system = [
            {"role": "system", "content": t}
            for t in json.loads((folder / "system_messages.json").read_text())
        ]
    else:
        system = [{"role": "system", "content": (folder / "system_prompt.txt").read_text(encoding="utf-8")}]
    tools = json.loads((folder / "tools.json").read_text(encoding="utf-8"))
    body: dict[str, Any] = {"model": "m", "messages": [*system, {"role": "user", "content": "Start."}]}
    if tools:
        body["tools"] = tools
    return body


def system_text(body: dict[str, Any]) -> str:
    return "\n\n".join(m["content"] for m in body["messages"] if m["role"] == "system")


def volatile_fields(folder: Path) -> list[dict[str, Any]]:
    return [
        f
        for f in json.loads((folder / "volatile.json").read_text())["fields"]
        if f["file"] == "system_prompt.txt"
    ]


@pytest.fixture
def agents_dir(shared_dir: Path) -> Path:
    path = shared_dir / "agents"
    if not path.is_dir():
        pytest.skip(f"real agent prompts not found at {path}")
    return path


@pytest.mark.parametrize("agent", REAL)
@pytest.mark.parametrize(
    "config", [{}, MOVE, {"rules": {"env_block": {"enabled": True}, "volatile_date": {"mode": "move"}}}]
)
def test_real_prompts_idempotent_and_semantics_kept(
    agents_dir: Path, agent: str, config: dict[str, Any]
) -> None:
    raw = real_request(agents_dir / agent)
    canon = Canonicalizer(CanonicalConfig.model_validate(config), strict=True)
    once = canon.apply(raw, api="chat").body
    assert orjson.dumps(canon.apply(once, api="chat").body) == orjson.dumps(once)
    # Tools: same set of definitions (dict equality ignores key order), only reordered.
    key = lambda t: t["function"]["name"]  # noqa: E731
    assert sorted(once.get("tools", []), key=key) == sorted(raw.get("tools", []), key=key)

    # Code blocks and patches of the system prompt survive byte for byte.
    def protected(text: str) -> list[str]:
        lines = text.split("\n")
        mask, _ = protected_line_mask(lines)
        return [line for line, p in zip(lines, mask, strict=True) if p]

    assert protected(system_text(once)) == protected(system_text(raw))


def test_codex_wire_shape_matches_its_plain_shape(agents_dir: Path) -> None:
    plain = json.loads((agents_dir / "codex" / "tools.json").read_text())
    wire = json.loads((agents_dir / "codex" / "tools.wire.json").read_text())
    canon = Canonicalizer(CanonicalConfig(), strict=True)
    a = canon.apply({"messages": [], "tools": plain}, api="chat").body["tools"]
    b = canon.apply({"messages": [], "tools": wire}, api="chat").body["tools"]
    assert [t["function"] for t in a] == [t["function"] for t in b]
    assert [orjson.dumps(t["function"]) for t in a] == [orjson.dumps(t["function"]) for t in b]


@pytest.mark.parametrize("agent", REAL)
def test_rules_fire_where_volatile_json_says(agents_dir: Path, agent: str) -> None:
    folder = agents_dir / agent
    raw = real_request(folder)
    day = Canonicalizer(CanonicalConfig(), strict=True).apply(raw, api="chat").body
    move_env = (
        Canonicalizer(
            CanonicalConfig.model_validate(
                {"rules": {"volatile_date": {"mode": "move"}, "env_block": {"enabled": True}}}
            ),
            strict=True,
        )
        .apply(raw, api="chat")
        .body
    )
    checked = 0
    for field in volatile_fields(folder):
        pattern = re.compile(field["regex"])
        if not pattern.search(system_text(raw)):
            continue
        moved_out = "\n".join(m["content"] for m in move_env["messages"] if m["role"] == "user")
        if re.search(r"\\d\{4\}", field["regex"]):  # a date field
            checked += 1
            assert not pattern.search(system_text(move_env)), field["name"]
            assert field["example"] in moved_out, field["name"]
            if ":" in field["example"]:  # a clock: day mode keeps only the date
                assert field["example"] not in system_text(day)
                assert field["example"].split(" ")[0] in system_text(day)
        elif field["name"] == "system_information":
            checked += 1
            assert not pattern.search(system_text(move_env))
            assert "SYSTEM INFORMATION\n\nOperating System:" in moved_out
    expected = {"goose": 1, "opencode": 1, "cline": 1, "cline-xml": 1}.get(agent, 0)
    assert checked == expected
