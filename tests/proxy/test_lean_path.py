"""The APIs' fixed-path endpoints are served before the framework's stack (proxy/endpoints.py), with
the same middleware and error shapes; every other request still goes through the framework."""

from __future__ import annotations

import httpx

from proxy.pipeline import Pipeline
from proxy.server import ServerThread
from tests.helpers.gateway import gateway_app

CHAT = {"model": "model-0", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_completions_skip_the_framework_stack_and_the_operator_side_does_not(rank_servers):
    (rank,) = rank_servers.stub(1)
    app = gateway_app([rank], policy="round_robin")
    entered: list[str] = []
    with ServerThread(app) as server:
        assert httpx.get(server.url + "/health").status_code == 200  # the framework builds its stack
        stack = app.middleware_stack
        assert stack is not None

        async def counting(scope, receive, send):
            entered.append(scope["path"])
            await stack(scope, receive, send)

        app.middleware_stack = counting
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
        assert httpx.post(server.url + "/v1/completions", json={**CHAT, "prompt": "hi"}).status_code == 200
        assert entered == []
        assert httpx.get(server.url + "/v1/chat/completions").status_code == 405
        assert httpx.get(server.url + "/metrics").status_code == 200
        assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert entered == ["/v1/chat/completions", "/metrics", "/v1/nothing"]


def test_an_unexpected_error_on_the_lean_path_answers_500_in_the_error_shape(rank_servers, monkeypatch):
    (rank,) = rank_servers.stub(1)

    async def broken(self, request, api, endpoint):
        raise RuntimeError("a bug")

    monkeypatch.setattr(Pipeline, "handle", broken)
    with ServerThread(gateway_app([rank], policy="round_robin")) as server:
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
        assert response.status_code == 500
        assert response.json()["error"]["type"] == "internal_error"
        assert response.headers["x-prefixgate-backend"]
        # the server is still serving
        assert httpx.get(server.url + "/health").status_code == 200


def test_the_lean_path_authenticates_and_bounds_headers_as_the_framework_path(rank_servers):
    (rank,) = rank_servers.stub(1)
    app = gateway_app([rank], api_keys=["k1"], policy="round_robin", max_header_bytes=2_000)
    with ServerThread(app) as server:
        url = server.url + "/v1/chat/completions"
        assert httpx.post(url, json=CHAT).status_code == 401
        assert httpx.post(url, json=CHAT, headers={"authorization": "Bearer nope"}).status_code == 401
        assert httpx.post(url, json=CHAT, headers={"authorization": "Bearer k1"}).status_code == 200
        big = {"authorization": "Bearer k1", "x-pad": "x" * 3_000}
        response = httpx.post(url, json=CHAT, headers=big)
        assert response.status_code == 413 and response.json()["error"]["code"] == "headers_too_large"
    received = rank.behavior.received
    assert len(received) == 1
