"""What an operator reads over HTTP (issue 21): liveness and readiness, a rank going down and back in
the log with its reason, and the endpoints agreeing with each other (error codes, shapes, headers)."""

from __future__ import annotations

import logging

import httpx

from tests.helpers.wait import wait_until

HI = [{"role": "user", "content": "hi"}]


def chat(url: str, model: str, messages: list[dict[str, str]], **headers: str) -> httpx.Response:
    response = httpx.post(
        url + "/v1/chat/completions", json={"model": model, "messages": messages}, headers=headers, timeout=10
    )
    assert response.status_code == 200, response.text
    return response


def test_the_fingerprint_tells_models_apart(rank_servers, proxy):
    server = proxy(rank_servers.stub(1))
    first = chat(server.url, "model-a", HI).headers["x-prefixgate-session"]
    other = chat(server.url, "model-b", HI).headers["x-prefixgate-session"]
    again = chat(server.url, "model-a", HI).headers["x-prefixgate-session"]
    assert first.startswith("fp-") and other.startswith("fp-")
    assert first != other and first == again


def test_readiness_waits_for_a_healthy_rank_and_liveness_tells_it(rank_servers, proxy, caplog):
    (rank,) = rank_servers.stub(1)
    rank.stop()
    port = rank.server.port
    with caplog.at_level(logging.INFO, logger="prefixgate.health"):
        server = proxy([rank])
        ready = httpx.get(server.url + "/ready")
        assert ready.status_code == 503
        body = ready.json()
        assert body["status"] == "not_ready" and body["healthy_backends"] == []
        assert f"cannot connect to 127.0.0.1:{port}" in body["down"][rank.name]
        health = httpx.get(server.url + "/health")
        assert health.status_code == 200  # alive: an orchestrator must not restart it for its ranks
        assert health.json()["status"] == "no_healthy_backend" and health.json()["healthy_backends"] == 0

        rank.restart()
        wait_until(lambda: httpx.get(server.url + "/ready").status_code == 200, "never became ready")
        # a stub rank has no vllm:cache_config_info: ready to serve, degraded, naming what it lacks
        assert httpx.get(server.url + "/ready").json() == {
            "status": "degraded",
            "healthy_backends": [rank.name],
            "missing": {rank.name: ["block size", "pool size"]},
        }
        assert httpx.get(server.url + "/health").json()["status"] == "ok"

        rank.behavior.healthy = False
        wait_until(lambda: httpx.get(server.url + "/ready").status_code == 503, "never went unready")
    lines = [r.getMessage() for r in caplog.records if r.name == "prefixgate.health"]
    down = [line for line in lines if f"rank {rank.name} at {rank.url} is down: " in line]
    assert any(f"cannot connect to 127.0.0.1:{port}" in line for line in down), lines
    assert any("GET /health answered 503" in line for line in down), lines
    assert any(
        f"rank {rank.name} at {rank.url} is healthy again after " in line and "cannot connect" in line
        for line in lines
    ), lines


def test_probes_need_no_key(rank_servers, proxy):
    server = proxy(rank_servers.stub(1), api_keys=["sk-client"], admin_token="admin")
    assert httpx.get(server.url + "/ready").status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401


def test_models_without_a_healthy_rank_has_the_chat_error_code(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    rank.stop()
    server = proxy([rank])
    models = httpx.get(server.url + "/v1/models")
    completion = httpx.post(server.url + "/v1/chat/completions", json={"model": "m", "messages": HI})
    assert models.status_code == completion.status_code == 503
    assert models.json()["error"]["code"] == completion.json()["error"]["code"] == "no_healthy_backend"


def test_admin_sessions_agree_on_breaks_and_carry_the_turn_log(rank_servers, proxy):
    server = proxy(rank_servers.stub(1), policy="prefix_affinity")
    messages = [{"role": "system", "content": "be brief " * 40}, *HI]
    chat(server.url, "m", messages, **{"x-session-id": "s1"})
    edited = [{"role": "system", "content": "be terse " * 40}, *HI]
    chat(server.url, "m", edited, **{"x-session-id": "s1", "x-prefixgate-canonicalize": "off"})
    (row,) = httpx.get(server.url + "/admin/sessions").json()["data"]
    detail = httpx.get(server.url + "/admin/sessions/s1").json()
    assert "breaks" not in row and row["break_count"] == detail["break_count"] == len(detail["breaks"]) == 1
    assert detail["breaks"][0]["cause"] == "system_edited"
    assert [t["turn"] for t in detail["turns_log"]] == [0, 1]
    overview = httpx.get(server.url + "/admin/overview/sessions/s1").json()
    assert detail["turns_log"] == overview["turns_log"]


def test_a_prompt_under_one_block_is_expected_to_hit_0(rank_servers, proxy):
    server = proxy(rank_servers.stub(1), policy="prefix_affinity")
    response = chat(server.url, "m", HI)
    assert response.headers["x-prefixgate-estimated-cached-tokens"] == "0"


def test_no_redis_gauge_without_redis(rank_servers, proxy):
    server = proxy(rank_servers.stub(1))
    metrics = httpx.get(server.url + "/metrics").text
    assert "prefixgate_backend_up" in metrics and "prefixgate_index_redis_up" not in metrics
    assert "prefixgate_redis_writes_queued" not in metrics and "prefixgate_redis_write_wait" not in metrics
    assert "prefixgate_session_saves_dropped" not in metrics
