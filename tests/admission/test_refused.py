"""What admission does with requests that cannot or did not run (issue 21): a prompt larger than any
rank can hold is answered 400 at once in the client API's error shape, never queued; a request the
rank refused or that failed releases what admission counted for it at once."""

from __future__ import annotations

import httpx
import pytest

from tests.admission.conftest import chat, metric, prompt_of

STRICT = {"admission_wait": 5.0, "session_idle_ttl": 60}


def active_sessions(url: str) -> list[dict]:
    answer = httpx.get(url + "/admin/sessions", params={"active": "1"}, timeout=5)
    return answer.json()["data"]


def test_a_prompt_larger_than_any_pool_is_answered_400_at_once_never_queued(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1)  # a 2,048-token pool
    proxy = gateway(ranks, **STRICT)
    for key in ("a", "b"):
        assert chat(proxy.url, key, 700).status_code == 200  # the rank is full: a new session would wait
    refused = chat(proxy.url, "huge", 3000)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"
    assert "2048" in error["message"]
    assert not metric(proxy.url, "prefixgate_admission_queued_total")
    assert metric(proxy.url, "prefixgate_admission_rejected_total", reason="context_length") == 1
    assert {s["id"] for s in active_sessions(proxy.url)} == {"a", "b"}

    body = {
        "model": "sim",
        "max_tokens": 16,
        "messages": [{"role": "user", "content": prompt_of("huge", 3000)}],
    }
    anthropic = httpx.post(proxy.url + "/v1/messages", json=body, headers={"x-session-id": "m"}, timeout=20)
    assert anthropic.status_code == 400
    data = anthropic.json()
    assert data["type"] == "error" and data["error"]["type"] == "invalid_request_error"
    assert "largest any rank can hold" in data["error"]["message"]


def test_the_context_length_comes_from_the_ranks_models(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1, kv_tokens=100_000, max_model_len=1000)
    proxy = gateway(ranks, **STRICT)
    assert chat(proxy.url, "fits", 500).status_code == 200
    refused = chat(proxy.url, "long", 1500)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["code"] == "context_length_exceeded" and "1000" in error["message"]
    assert httpx.get(proxy.url + "/health", timeout=5).json()  # still up


@pytest.mark.parametrize(
    ("rank_status", "client_status"),
    [(400, 400), (500, 502)],  # the rank refused it; no rank answered it (retried, then failed)
)
def test_a_request_that_fails_releases_its_new_sessions_room(  # type: ignore[no-untyped-def]
    rank_servers, gateway, rank_status: int, client_status: int
) -> None:
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, **{**STRICT, "admission_wait": 0.1})
    ranks[0].set_faults(error_rate=1.0, error_status=rank_status)
    assert chat(proxy.url, "a", 700).status_code == client_status
    ranks[0].clear_faults()
    assert active_sessions(proxy.url) == []
    assert metric(proxy.url, "prefixgate_rank_working_set_tokens", backend=ranks[0].name) == 0
    # a counted nothing: two 700-token sessions still fit the 1,638-token budget
    assert chat(proxy.url, "b", 700).status_code == 200
    assert chat(proxy.url, "c", 700).status_code == 200


def test_a_failed_turn_of_an_active_session_releases_its_growth(rank_servers, gateway) -> None:  # type: ignore[no-untyped-def]
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, **{**STRICT, "admission_wait": 0.1})
    assert chat(proxy.url, "a", 300).status_code == 200
    before = httpx.get(proxy.url + "/admin/sessions/a", timeout=5).json()
    ranks[0].set_faults(error_rate=1.0, error_status=400)
    assert chat(proxy.url, "a", 1400).status_code == 400  # its next turn, refused
    ranks[0].clear_faults()
    after = httpx.get(proxy.url + "/admin/sessions/a", timeout=5).json()
    assert (after["turns"], after["context_tokens"]) == (before["turns"], before["context_tokens"])
    assert after["active"]
    # the 1,400 tokens it asked for never counted: another 1,000-token session fits beside it
    assert chat(proxy.url, "b", 1000).status_code == 200
