"""Issue 20's "Done when", measured with the real agent CLIs (Claude Code 2.1.332, Codex CLI 0.171.0,
opencode 1.18.33) through prefixgate with its defaults against simulated ranks that render system
before tools (``python -m tests.agents`` prints the same figures)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.agents.__main__ import targets


@pytest.fixture(scope="module")
def met(tier: dict[str, Any]) -> dict[str, tuple[bool, str]]:
    return targets(tier)


def check(met: dict[str, tuple[bool, str]], target: str) -> None:
    ok, figure = met[target]
    assert ok, f"{target}: {figure}"


def test_a_file_edited_between_continue_prompts_costs_no_hits(met: dict[str, tuple[bool, str]]) -> None:
    check(met, "claude edit == no edit")


def test_sessions_in_other_directories_share_system_and_tools(met: dict[str, tuple[bool, str]]) -> None:
    check(met, "3 dirs share system + tools")


def test_no_false_break_in_any_agents_session(met: dict[str, tuple[bool, str]]) -> None:
    check(met, "no false break")


def test_side_requests_and_sub_agents_are_threads(met: dict[str, tuple[bool, str]]) -> None:
    check(met, "side requests and sub-agents are threads")


def test_estimates_within_one_block_of_the_reports(met: dict[str, tuple[bool, str]]) -> None:
    check(met, "|estimated - reported| <= 1 block")


def test_no_index_corrections_in_steady_state(met: dict[str, tuple[bool, str]]) -> None:
    check(met, "no index corrections in steady state")


def test_every_agents_sessions_are_keyed_by_its_own_session_header(met: dict[str, tuple[bool, str]]) -> None:
    check(met, "sessions identified from the agents' own headers")


def test_the_end_of_session_header_frees_the_seat_within_one_request(
    met: dict[str, tuple[bool, str]],
) -> None:
    check(met, "end-of-session header frees the seat within one request")


def test_every_agent_ran_multi_turn_sessions_with_tool_calls(tier: dict[str, Any]) -> None:
    """Each CLI really went through several requests (tool calls answered, resumed in a new process)."""
    assert tier["codex"]["requests"] >= 5
    assert all(s["requests"] >= 5 for s in tier["opencode"]["sessions"])
    assert tier["claude_edit"]["edit"]["requests"] >= 7
