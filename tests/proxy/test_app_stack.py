"""Every request takes the app's one path (proxy/asgi.py): its middleware (header bound, auth) and
its error shape for an unexpected exception."""

from __future__ import annotations

import httpx

from proxy.pipeline import Pipeline
from proxy.server import ServerThread
from tests.helpers.gateway import gateway_app

CHAT = {"model": "model-0", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_an_unexpected_error_on_an_api_endpoint_answers_500_in_the_error_shape(rank_servers, monkeypatch):
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


def test_api_endpoints_are_authenticated_and_their_headers_bounded(rank_servers):
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
