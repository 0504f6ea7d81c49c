"""What this process keeps per session between turns, against ``--session-memory-mb``: sessions
dropped to make room are counted and said, so an operator can see the budget is too small."""

from __future__ import annotations

import logging
import re

import httpx
import pytest

from tests.helpers.gateway import start_gateway
from tests.helpers.ranks import RankServers


def metric(text: str, name: str) -> float:
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found is not None, name
    return float(found.group(1))


def eight_sessions_then_metrics(url: str) -> str:
    """Eight sessions of ~8k tokens each (one turn), then the gateway's ``/metrics``."""
    for n in range(8):
        text = f"session {n}: " + "some repository context to keep " * 1200
        body = {"model": "sim", "messages": [{"role": "user", "content": text}], "max_tokens": 4}
        answer = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": f"m{n}"})
        assert answer.status_code == 200
    return httpx.get(url + "/metrics").text


def test_sessions_dropped_for_room_are_counted_and_said(
    rank_servers: RankServers, caplog: pytest.LogCaptureFixture
) -> None:
    ranks = rank_servers.sim(1)
    # ~0.25 MB: a few sessions of ~8k tokens (tokens and block hashes, the explainer's body) fill it
    gateway = start_gateway(ranks, session_memory_mb=0.25)
    try:
        with caplog.at_level(logging.WARNING, logger="prefixgate"):
            text = eight_sessions_then_metrics(gateway.url)
    finally:
        gateway.stop()
    assert metric(text, "prefixgate_session_memory_evictions_total") >= 1
    budget = metric(text, "prefixgate_session_memory_budget_bytes")
    assert budget == 0.25 * 1024 * 1024
    assert 0 < metric(text, "prefixgate_session_memory_bytes") <= budget
    said = [r.getMessage() for r in caplog.records if "session memory full" in r.getMessage()]
    assert len(said) == 1  # once per report interval, however many sessions went
    assert "--session-memory-mb 0.25" in said[0] and "tokenized whole" in said[0]


def test_a_budget_that_holds_every_session_drops_none(rank_servers: RankServers) -> None:
    gateway = start_gateway(rank_servers.sim(1))
    try:
        text = eight_sessions_then_metrics(gateway.url)
    finally:
        gateway.stop()
    assert metric(text, "prefixgate_session_memory_evictions_total") == 0
    assert metric(text, "prefixgate_session_memory_bytes") > 0
