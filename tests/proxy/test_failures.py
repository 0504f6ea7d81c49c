"""Bad input and failing ranks: every request gets an answer, with an OpenAI error body."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import openai
import orjson
import pytest

from tests.helpers.wait import wait_until

CHAT = {"model": "model-0", "messages": [{"role": "user", "content": "hi"}]}


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


@pytest.mark.parametrize(
    ("content", "fragment"),
    [(b"{not json", "not valid JSON"), (b"[1, 2]", "must be a JSON object"), (b"", "empty")],
)
def test_invalid_bodies_get_400(rank_servers, proxy, content, fragment):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank])
    response = httpx.post(server.url + "/v1/chat/completions", content=content)
    error = assert_openai_error(response, 400)
    assert fragment in error["message"]
    assert rank.behavior.received == []


def test_wrong_field_types_get_400(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank])
    for body, param in (
        ({"model": "m", "messages": "hi"}, "messages"),
        ({**CHAT, "stream": "yes"}, "stream"),
        ({"model": 3, "messages": []}, "model"),
        ({"model": "m"}, None),
    ):
        path = "/v1/completions" if param is None else "/v1/chat/completions"
        error = assert_openai_error(httpx.post(server.url + path, json=body), 400)
        assert error["param"] == (param or "prompt")


def test_unknown_path_and_method(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank])
    assert_openai_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(server.url + "/v1/chat/completions"), 405)


def test_huge_body_gets_413(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank], max_body_bytes=10_000)
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 20_000 + b'"}]}'
    error = assert_openai_error(httpx.post(server.url + "/v1/chat/completions", content=big), 413)
    assert "10000" in error["message"]

    def chunked():  # no Content-Length: the limit holds while reading
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    assert_openai_error(httpx.post(server.url + "/v1/chat/completions", content=chunked()), 413)
    assert rank.behavior.received == []


def test_default_body_limit_is_32_mib(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    server = proxy([rank])
    declared = str(32 * 1024 * 1024 + 1)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n"
            "Content-Type: application/json\r\n\r\n{".encode()
        )
        reply = sock.recv(65536).decode()
    assert reply.startswith("HTTP/1.1 413")


def test_no_healthy_backend_gets_503(rank_servers, proxy):
    (rank,) = rank_servers.stub(1)
    rank.stop()
    server = proxy([rank])
    error = assert_openai_error(httpx.post(server.url + "/v1/chat/completions", json=CHAT), 503)
    assert error["code"] == "no_healthy_backend"


def test_refused_connection_is_retried_on_another_rank(rank_servers, proxy):
    down, up = rank_servers.stub(2)
    server = proxy([down, up], health_interval=60)  # only the passive check can notice
    down.stop()
    for _ in range(4):
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
        assert response.status_code == 200
        assert response.headers["x-prefixgate-backend"] == up.name
    assert len(up.behavior.received) == 4


def test_5xx_is_retried_then_502(rank_servers, proxy):
    failing, healthy = rank_servers.stub(2)
    failing.behavior.status = 500
    server = proxy([failing, healthy])
    for _ in range(3):
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
        assert response.status_code == 200
        assert response.headers["x-prefixgate-backend"] == healthy.name
    healthy.behavior.status = 503
    error = assert_openai_error(httpx.post(server.url + "/v1/chat/completions", json=CHAT), 502)
    assert "HTTP" in error["message"]


def test_upstream_4xx_passes_through(rank_servers, proxy):
    (rank,) = rank_servers.stub(1, status=422)
    server = proxy([rank])
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 422
    assert response.json()["error"]["message"] == "stub says 422"
    assert response.headers["x-prefixgate-backend"] == rank.name


def test_hung_rank_times_out_and_is_retried(rank_servers, proxy):
    hung, healthy = rank_servers.stub(2)
    hung.behavior.hang = True
    server = proxy([hung, healthy], read_timeout=0.5)
    for _ in range(2):
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 200
        assert response.headers["x-prefixgate-backend"] == healthy.name


def test_rank_dying_mid_stream_ends_with_an_sse_error(rank_servers, proxy):
    (rank,) = rank_servers.stub(1, chunks=5, die_after=2)
    server = proxy([rank])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=10)
    received = []
    with pytest.raises(openai.APIError) as info:
        for chunk in client.chat.completions.create(model="model-0", messages=CHAT["messages"], stream=True):
            received.append(chunk.choices[0].delta.content)
    assert received == ["word0 ", "word1 "]
    assert "broke mid-stream" in str(info.value)
    # and the proxy keeps serving
    rank.behavior.die_after = None
    assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    assert 'prefixgate_stream_errors_total{backend="stub-0"} 1.0' in metrics


def test_client_disconnect_mid_stream_cancels_the_upstream(rank_servers, proxy):
    (rank,) = rank_servers.stub(1, chunks=200, chunk_delay=0.05)
    server = proxy([rank])
    with httpx.stream(
        "POST", server.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10
    ) as response:
        next(response.iter_raw())
    wait_until(lambda: rank.behavior.streams_closed == 1)
    assert rank.behavior.chunks_sent < 100
    wait_until(lambda: "prefixgate_client_disconnects_total" in httpx.get(server.url + "/metrics").text)
    health = httpx.get(server.url + "/health").json()
    assert health["backends"][0]["in_flight"] == 0


def test_client_disconnect_while_waiting_for_first_byte(rank_servers, proxy):
    (rank,) = rank_servers.stub(1, hang=True)
    server = proxy([rank])
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=0.5)
    wait_until(lambda: httpx.get(server.url + "/health").json()["backends"][0]["in_flight"] == 0)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'prefixgate_client_disconnects_total{endpoint="/v1/chat/completions"} 1.0' in metrics


def test_unhealthy_rank_gets_no_traffic_until_it_recovers(rank_servers, proxy):
    flaky, steady = rank_servers.stub(2)
    server = proxy([flaky, steady], health_interval=0.1)
    flaky.behavior.healthy = False
    wait_until(lambda: not httpx.get(server.url + "/health").json()["backends"][0]["healthy"])
    before = len(flaky.behavior.received)
    for _ in range(6):
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert len(flaky.behavior.received) == before
    flaky.behavior.healthy = True
    wait_until(lambda: httpx.get(server.url + "/health").json()["backends"][0]["healthy"])
    for _ in range(6):
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert len(flaky.behavior.received) > before


def test_stopped_rank_returns_to_service_after_restart(rank_servers, proxy):
    rank, other = rank_servers.stub(2)
    server = proxy([rank, other], health_interval=0.1)
    rank.stop()
    wait_until(lambda: not httpx.get(server.url + "/health").json()["backends"][0]["healthy"])
    rank.restart()
    wait_until(lambda: httpx.get(server.url + "/health").json()["backends"][0]["healthy"])
    names = {
        httpx.post(server.url + "/v1/chat/completions", json=CHAT).headers["x-prefixgate-backend"]
        for _ in range(4)
    }
    assert names == {rank.name, other.name}


def test_a_request_cancelled_while_its_tail_lands_is_counted_as_closed_and_releases_its_rank(
    rank_servers, monkeypatch
):
    """The server cancels a request (its graceful-shutdown timeout) while the answer waits for the
    prompt's tail to land: the rank's count is released and the request is counted as a 499."""
    from proxy.server import ServerThread
    from tests.helpers.gateway import gateway_app

    app = gateway_app(rank_servers.stub(1), policy="prefix_affinity")
    server = ServerThread(app).start()
    try:
        gateway = app.state.gateway

        async def cancelled(ctx: object) -> None:
            raise asyncio.CancelledError

        monkeypatch.setattr(gateway.pipeline.blocks, "settle", cancelled)
        # uvicorn answers a request whose app raised before the answer started with a 500
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 500
        (rank,) = gateway.fleet
        assert rank.in_flight == 0
        metrics = httpx.get(server.url + "/metrics").text
        closed = [
            line
            for line in metrics.splitlines()
            if line.startswith("prefixgate_requests_total{") and 'status="499"' in line
        ]
        assert len(closed) == 1 and closed[0].endswith(" 1.0"), closed
    finally:
        server.stop()


def test_a_stream_stalled_after_its_first_chunk_ends_with_an_error_at_the_read_timeout(rank_servers, proxy):
    gate = threading.Event()
    (rank,) = rank_servers.stub(1, chunks=4)
    rank.behavior.gate = gate  # the rank sends one chunk, then nothing
    server = proxy([rank], read_timeout=0.5)
    try:
        with httpx.stream(
            "POST", server.url + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=20
        ) as response:
            assert response.status_code == 200
            text = "".join(response.iter_text())
    finally:
        gate.set()
    events = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    assert len(events) == 2 and "[DONE]" not in events
    assert "word0" in events[0]
    error = orjson.loads(events[1])["error"]
    assert "broke mid-stream: SocketTimeoutError" in error["message"]
    assert rank.behavior.chunks_sent == 1
    # and the next stream, over a fresh connection, is whole
    with httpx.stream("POST", server.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as response:
        assert "[DONE]" in "".join(response.iter_text())
