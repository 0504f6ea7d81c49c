"""The admin API per caller: a client key sees and ends only its own sessions; the admin token, all."""

from __future__ import annotations

from pathlib import Path

import httpx

from tests.admission.conftest import chat

ALICE = {"authorization": "Bearer key-alice"}
BOB = {"authorization": "Bearer key-bob"}
ADMIN = {"authorization": "Bearer admin-token"}


def test_a_client_key_cannot_read_or_end_another_clients_session(
    rank_servers, gateway, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    keys = tmp_path / "keys.yaml"
    keys.write_text("- {key: key-alice, label: alice}\n- {key: key-bob, label: bob}\n")
    proxy = gateway(
        rank_servers.sim(1), api_keys_file=str(keys), admin_token="admin-token", session_idle_ttl=60
    )
    assert chat(proxy.url, "alice-1", 100, ALICE).status_code == 200
    assert chat(proxy.url, "bob-1", 100, BOB).status_code == 200

    def get(path: str, headers: dict[str, str]) -> httpx.Response:
        return httpx.get(proxy.url + path, headers=headers, timeout=5)

    # bob's key: alice's session is invisible, in the list, by id, and to a delete
    assert [r["id"] for r in get("/admin/sessions", BOB).json()["data"]] == ["bob-1"]
    assert get("/admin/sessions/alice-1", BOB).status_code == 404
    refused = httpx.delete(proxy.url + "/admin/sessions/alice-1", headers=BOB, timeout=5)
    assert refused.status_code == 404
    # ... and it was not ended: alice still sees it, with its turn
    mine = get("/admin/sessions/alice-1", ALICE)
    assert mine.status_code == 200 and mine.json()["client"] == "alice" and mine.json()["turns"] == 1
    # the admin token sees every session, reads any, and may end any
    assert {r["id"] for r in get("/admin/sessions", ADMIN).json()["data"]} == {"alice-1", "bob-1"}
    assert get("/admin/sessions/bob-1", ADMIN).json()["client"] == "bob"
    assert httpx.delete(proxy.url + "/admin/sessions/bob-1", headers=ADMIN, timeout=5).status_code == 200
    # no key at all gets nothing
    assert get("/admin/sessions", {}).status_code == 401
