"""Tenants: with client keys, one client can neither write into another's session, nor escape its own
session cap through another's key, nor read another's stored answers, nor learn other clients'
session ids or where the ranks are."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import SIM_MODEL

ALICE = {"authorization": "Bearer key-alice"}
BOB = {"authorization": "Bearer key-bob"}
ADMIN = {"authorization": "Bearer admin-token"}
SYSTEM = "You are a careful agent.\n" * 60


def keys_file(tmp_path: Path, bob_sessions: int | None = None) -> str:
    path = tmp_path / "keys.yaml"
    cap = f", max_sessions: {bob_sessions}" if bob_sessions else ""
    path.write_text(f"- {{key: key-alice, label: alice}}\n- {{key: key-bob, label: bob{cap}}}\n")
    return str(path)


def turn(url: str, who: dict[str, str], session: str, text: str) -> httpx.Response:
    body = {
        "model": SIM_MODEL,
        "messages": [{"role": "system", "content": SYSTEM + text}, {"role": "user", "content": "go on"}],
        "max_tokens": 4,
    }
    return httpx.post(
        url + "/v1/chat/completions", json=body, headers={**who, "x-session-id": session}, timeout=10
    )


def test_another_clients_session_id_starts_a_session_of_ones_own(rank_servers, gateway, tmp_path):
    proxy = gateway(
        rank_servers.sim(1),
        api_keys_file=keys_file(tmp_path),
        admin_token="admin-token",
        policy="prefix_affinity",
    )
    assert turn(proxy.url, ALICE, "shared", "alice's own words").status_code == 200
    answer = turn(proxy.url, BOB, "shared", "BOB WAS HERE")
    assert answer.status_code == 200
    assert answer.headers["x-prefixgate-session"] == "shared"  # bob sees his own id as he sent it
    mine = httpx.get(proxy.url + "/admin/sessions/shared", headers=ALICE, timeout=5).json()
    assert mine["client"] == "alice" and mine["turns"] == 1 and mine["breaks"] == []
    assert "BOB WAS HERE" not in str(mine)
    rows = httpx.get(proxy.url + "/admin/sessions", headers=ADMIN, timeout=5).json()["data"]
    assert sorted((r["id"], r["client"]) for r in rows) == [("shared", "alice"), ("shared", "bob")]
    # the admin names the client when an id is ambiguous
    assert httpx.get(proxy.url + "/admin/sessions/shared", headers=ADMIN, timeout=5).status_code == 409
    bobs = httpx.get(proxy.url + "/admin/sessions/bob/shared", headers=ADMIN, timeout=5).json()
    assert bobs["client"] == "bob" and bobs["turns"] == 1


def test_another_clients_session_id_does_not_escape_the_session_cap(rank_servers, gateway, tmp_path):
    proxy = gateway(
        rank_servers.sim(1), api_keys_file=keys_file(tmp_path, bob_sessions=1), session_idle_ttl=60
    )
    assert turn(proxy.url, ALICE, "alice-1", "a").status_code == 200
    assert turn(proxy.url, BOB, "bob-1", "b").status_code == 200
    refused = turn(proxy.url, BOB, "alice-1", "b again")  # alice's id is a second session of bob's
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "too_many_sessions"


def test_session_ids_and_rank_urls_are_not_shown_to_clients(rank_servers, gateway, tmp_path):
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, api_keys_file=keys_file(tmp_path))  # no admin token: clients may read /metrics
    assert turn(proxy.url, ALICE, "alice-secret-session", "a").status_code == 200
    metrics = httpx.get(proxy.url + "/metrics", headers=BOB, timeout=5).text
    assert "alice-secret-session" not in metrics
    overview = httpx.get(proxy.url + "/admin/overview", headers=BOB, timeout=5).json()
    assert [r["url"] for r in overview["ranks"]] == [None]
    health = httpx.get(proxy.url + "/health", timeout=5).json()
    assert ranks[0].url not in str(health) and health["healthy_backends"] == 1


def test_rank_urls_and_session_series_are_shown_to_the_admin(rank_servers, gateway, tmp_path):
    ranks = rank_servers.sim(1)
    proxy = gateway(ranks, api_keys_file=keys_file(tmp_path), admin_token="admin-token")
    for _ in range(2):
        assert turn(proxy.url, ALICE, "alice-1", "a").status_code == 200
    overview = httpx.get(proxy.url + "/admin/overview", headers=ADMIN, timeout=5).json()
    assert [r["url"] for r in overview["ranks"]] == [ranks[0].url]
    metrics = httpx.get(proxy.url + "/metrics", headers=ADMIN, timeout=5).text
    assert 'prefixgate_session_hit_rate{backend="sim-0",session="alice/alice-1"}' in metrics


@pytest.mark.parametrize("how", ["retrieve", "continue"])
def test_a_stored_answer_is_its_owners_only(rank_servers, gateway, tmp_path, how):
    proxy = gateway(rank_servers.sim(1), api_keys_file=keys_file(tmp_path))
    body = {"model": SIM_MODEL, "input": "remember the number 42", "max_output_tokens": 4}
    stored = httpx.post(proxy.url + "/v1/responses", json=body, headers=ALICE, timeout=10)
    assert stored.status_code == 200, stored.text
    response_id = stored.json()["id"]
    if how == "retrieve":
        assert (
            httpx.get(f"{proxy.url}/v1/responses/{response_id}", headers=ALICE, timeout=10).status_code == 200
        )
        theirs = httpx.get(f"{proxy.url}/v1/responses/{response_id}", headers=BOB, timeout=10)
    else:
        follow = {**body, "input": "what was it?", "previous_response_id": response_id}
        assert (
            httpx.post(proxy.url + "/v1/responses", json=follow, headers=ALICE, timeout=10).status_code == 200
        )
        theirs = httpx.post(proxy.url + "/v1/responses", json=follow, headers=BOB, timeout=10)
    assert theirs.status_code == 404, theirs.text
    assert theirs.json()["error"]["code"] == "response_not_found"
