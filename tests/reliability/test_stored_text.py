"""No prompt or completion text where it was not asked for: stored break records keep positions and
digests (the text only with --log-bodies), a malformed SSE event is described, not quoted."""

from __future__ import annotations

import logging

import httpx
import pytest
import redis

from tests.reliability.conftest import SIM_MODEL, sse_events

SECRET = "the launch code is 0000-SWORDFISH"


def system_edit(url: str, session: str) -> dict:
    """Two turns whose system prompts differ on one line; the session's record as the admin sees it."""
    lines = [f"Rule {i}: be careful with file {i}." for i in range(40)]
    for turn, line in enumerate((f"Rule 20: {SECRET} (old)", f"Rule 20: {SECRET} (new)")):
        lines[20] = line
        body = {
            "model": SIM_MODEL,
            "messages": [{"role": "system", "content": "\n".join(lines)}, {"role": "user", "content": "go"}],
            "max_tokens": 4,
        }
        response = httpx.post(url + "/v1/chat/completions", json=body, headers={"x-session-id": session})
        assert response.status_code == 200, (turn, response.text)
    return httpx.get(f"{url}/admin/sessions/{session}", timeout=5).json()


@pytest.mark.parametrize("log_bodies", [False, True])
def test_stored_break_records_keep_prompt_text_only_when_bodies_may_be_logged(
    rank_servers, gateway, redis_server, log_bodies
):
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, policy="prefix_affinity", redis_url=redis_server.url, log_bodies=log_bodies)
    record = system_edit(proxy.url, "s-secret")
    (found,) = [b for b in record["breaks"] if b["cause"] == "system_edited"]
    line = found["line"]
    assert line["number"] == 21 and line["column"] > 0
    assert line["old_digest"] != line["new_digest"]
    client = redis.Redis.from_url(redis_server.url)
    stored = b"".join(client.lrange("prefixgate:sessions:b:s-secret", 0, -1))
    client.close()
    assert stored  # the break reached Redis
    if log_bodies:
        assert SECRET in line["new"] and SECRET.encode() in stored
    else:
        assert "old" not in line and "new" not in line
        assert SECRET.encode() not in stored


def test_a_malformed_sse_event_is_described_not_quoted(rank_servers, gateway, caplog):
    ranks = rank_servers.sim(2)
    proxy = gateway(ranks, retries=1)
    for rank in ranks:
        rank.set_faults(malformed_sse=True)
    caplog.set_level(logging.WARNING)
    body = {
        "model": SIM_MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 12,
        "stream": True,
    }
    response = httpx.post(proxy.url + "/v1/chat/completions", json=body, timeout=15)
    if response.status_code == 200:
        message = sse_events(response.text)[-1]["error"]["message"]
    else:
        message = response.json()["error"]["message"]
    assert "malformed SSE event" in message
    # the simulated rank's bad event is '{"id": "sim-malformed", "choices": [{"delta": {"content": '
    for text in [message, *(r.getMessage() for r in caplog.records)]:
        assert "sim-malformed" not in text and "delta" not in text, text
