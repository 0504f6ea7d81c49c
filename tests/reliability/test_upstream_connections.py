"""Connections to the ranks: a pooled connection the rank already closed never loses a request.

uvicorn (vLLM's API server) closes an idle keep-alive connection after 5 s; a request written on it
just as the rank's FIN arrives meets a reset before any response byte. ``ClosingRank`` makes that
race certain: it answers the first request of every connection and drops the connection, unanswered,
when a completion arrives on it afterwards. prefixgate must send such a request again on a fresh
connection to the same rank: the answer comes from the session's own rank, nothing counts as a
failure of it.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import orjson

from bench.sim import SimConfig, SimRankServer
from tests.helpers.tcp_server import ThreadedTcpServer
from tests.helpers.wait import wait_until
from tests.reliability.conftest import SIM_MODEL, chat, sse_events


class ClosingRank(ThreadedTcpServer):
    """A minimal OpenAI-compatible rank over raw HTTP/1.1 that drops reused connections carrying a
    completion (as a FIN racing the request would), and answers everything else."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name
        self.dropped = 0
        self.answered = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        served = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, path = head.split(b" ", 2)[:2]
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length) if length else b""
                if method == b"POST" and served:
                    self.dropped += 1
                    writer.transport.abort()  # a reset before any response byte
                    return
                served += 1
                writer.write(self._answer(method, path, body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()

    def _answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        kind = b"application/json"
        if method == b"GET" and path == b"/v1/models":
            payload = orjson.dumps({"object": "list", "data": [{"id": SIM_MODEL, "object": "model"}]})
        elif method == b"GET":
            payload = b"{}"
        else:
            self.answered += 1
            request = orjson.loads(body)
            message = {"role": "assistant", "content": f"from {self.name}"}
            answer = {"id": "c", "object": "chat.completion", "model": SIM_MODEL, "choices": []}
            if request.get("stream"):
                kind = b"text/event-stream"
                delta = {
                    "id": "c",
                    "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": message}],
                }
                payload = b"data: " + orjson.dumps(delta) + b"\n\ndata: [DONE]\n\n"
            else:
                answer["choices"] = [{"index": 0, "message": message, "finish_reason": "stop"}]
                payload = orjson.dumps(answer)
        head = b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (kind, len(payload))
        return head + payload


def test_a_stale_pooled_connection_is_retried_on_a_fresh_one_to_the_same_rank(gateway):
    ranks = [ClosingRank("closing-0").start(), ClosingRank("closing-1").start()]
    try:
        proxy = gateway([(r.name, r.url) for r in ranks], policy="session_hash", retries=1)
        with httpx.Client(base_url=proxy.url, timeout=10) as client:
            answered = []
            for turn in range(8):
                body = chat("x" * 400_000 if turn % 4 == 3 else f"turn {turn}", stream=turn % 2 == 1)
                response = client.post("/v1/chat/completions", json=body, headers={"x-session-id": "s-1"})
                assert response.status_code == 200, response.text
                if body["stream"]:
                    assert sse_events(response.text)[-1] == "[DONE]"
                answered.append(response.headers["x-prefixgate-backend"])
            metrics = client.get("/metrics").text
        assert answered == [answered[0]] * 8, answered  # the session never left its rank
        # every turn on a pooled connection met a dropped one (the fresh ones are not pooled)
        assert sum(r.dropped for r in ranks) >= 3
        assert "prefixgate_upstream_failures_total{" not in metrics
        assert "prefixgate_retries_total{" not in metrics
        assert f'prefixgate_upstream_reconnects_total{{backend="{answered[0]}"}}' in metrics
    finally:
        for rank in ranks:
            rank.stop()


def test_the_simulated_rank_closes_idle_connections_like_uvicorn():
    assert SimConfig().keep_alive_s == 5.0  # vLLM's API server: uvicorn's default
    with SimRankServer(SimConfig(time_scale=0, keep_alive_s=0.2)) as rank:
        sock = socket.create_connection(("127.0.0.1", rank.port), timeout=10)
        with sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            # then nothing: the rank closes the idle connection
            wait_until(lambda: sock.recv(4096) == b"", "the rank kept an idle connection open", timeout=10)


def test_a_rank_that_never_starts_a_stream_is_left_after_the_first_byte_timeout(rank_servers, gateway):
    ranks = rank_servers.sim(2)
    # the read timeout (between chunks) stays long: only the first byte is waited for briefly
    proxy = gateway(ranks, retries=1, first_byte_timeout=0.5, read_timeout=300)
    ranks[0].set_faults(hang=True)  # accepts, and answers /health, but never starts an answer
    for i in range(4):
        response = httpx.post(
            proxy.url + "/v1/chat/completions", json=chat(f"hung {i}", stream=True), timeout=30
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-prefixgate-backend"] == "sim-1"
        assert sse_events(response.text)[-1] == "[DONE]"
    metrics = httpx.get(proxy.url + "/metrics", timeout=5).text
    assert 'prefixgate_upstream_failures_total{backend="sim-0",reason="timeout"}' in metrics
