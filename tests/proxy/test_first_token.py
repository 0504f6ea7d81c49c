"""The prefill a request queues on its rank leaves the queue at its stream's first token (vLLM sends
its first chunk after the prefill); the prompt tokens it holds in flight leave at its end; a whole
answer's charge all leaves at its end. Each charge is released exactly once, whatever ends the
request: an answer, a retry on another rank, a stream that breaks, a client that leaves.

A request held before its first chunk (a stub holding it, a raw socket the test closes) keeps a known
charge on a rank, so a release counted twice shows as a queue below that charge."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from proxy.server import ServerThread
from tests.helpers.gateway import gateway_app
from tests.helpers.ranks import RankServers
from tests.helpers.wait import wait_until

PROMPT = "Read the repository and fix the failing test in the parser module, then explain. " * 40


def body(text: str, stream: bool) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": f"{text} {PROMPT}"}], "stream": stream}


@pytest.fixture
def gateway(rank_servers: RankServers) -> Iterator[Any]:
    """prefixgate over two stub ranks (least loaded: a request goes where nothing is held; one
    retry): the app, serving."""
    stubs = rank_servers.stub(2, model="m")
    app = gateway_app(stubs, policy="least_loaded", retries=1, health_interval=0.2)
    server = ServerThread(app).start()
    app.state.url, app.state.stubs, app.state.releases = server.url, stubs, []
    yield app
    for release in app.state.releases:
        release.set()
    server.stop()


def charges(app: Any) -> tuple[dict[str, int], dict[str, int]]:
    router = app.state.gateway.router
    return dict(router.queued_prefill), dict(router.inflight_tokens)


def only_held(
    ranks: Iterable[str], rank: str, prefill: int, tokens: int
) -> tuple[dict[str, int], dict[str, int]]:
    """The charges when only the held request is charged: ``prefill`` and ``tokens`` on ``rank``."""
    names = list(ranks)
    return {r: prefill if r == rank else 0 for r in names}, {r: tokens if r == rank else 0 for r in names}


class Held:
    """A non-streamed request sent on a raw socket, pending until ``close`` (its client leaves)."""

    def __init__(self, url: str, text: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        data = orjson.dumps(body(text, stream=False))
        self.sock = socket.create_connection((host, int(port)))
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
            f"x-session-id: {text}\r\ncontent-length: {len(data)}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + data)

    def close(self) -> None:
        self.sock.close()


def hold(app: Any, text: str) -> tuple[Held, str, int, int]:
    """A request pending on a rank that holds it (until the test ends; the next requests are
    answered): its socket, its rank and its charge there."""
    stubs = app.state.stubs
    release = threading.Event()
    app.state.releases.append(release)
    for stub in stubs:
        stub.behavior.hold = release
    received = sum(len(stub.behavior.received) for stub in stubs)
    held = Held(app.state.url, text)
    wait_until(lambda: any(charges(app)[1].values()), "the held request was never charged")
    # The proxy charges before it forwards: the stub must have read ``hold`` before it is cleared
    # (it reads it right after recording the request, without yielding), or it answers at once.
    wait_until(
        lambda: sum(len(stub.behavior.received) for stub in stubs) > received,
        "the held request never reached a rank",
    )
    queued, inflight = charges(app)
    (rank,) = [r for r in inflight if inflight[r]]
    for stub in stubs:
        stub.behavior.hold = None
    return held, rank, queued[rank], inflight[rank]


def test_a_streams_prefill_leaves_at_its_first_token_and_its_tokens_at_its_end(gateway: Any) -> None:
    stubs = gateway.state.stubs
    held, rank, prefill, tokens = hold(gateway, "holder")
    assert prefill > 0 and tokens >= prefill  # a whole answer: charged until it ends
    gate = threading.Event()
    for stub in stubs:
        stub.behavior.gate = gate
    with httpx.Client(base_url=gateway.state.url, timeout=30) as client:
        streams = []
        for i in range(2):  # both go to the rank the holder left free
            stream = client.stream("POST", "/v1/chat/completions", json=body(f"stream {i}", True))
            response = stream.__enter__()
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # its first chunk: the stream opened
            streams.append((stream, response, lines))
        queued, inflight = charges(gateway)
        # both streams' prefill left the queues; their prompt tokens are still in flight
        assert queued == {r: prefill if r == rank else 0 for r in queued}
        assert sum(inflight.values()) > tokens and all(inflight.values())
        gate.set()
        for stream, _response, lines in streams:
            assert [line for line in lines if line][-1] == "data: [DONE]"
            stream.__exit__(None, None, None)
    expected = only_held(queued, rank, prefill, tokens)
    wait_until(lambda: charges(gateway) == expected, lambda: f"charges {charges(gateway)} != {expected}")
    held.close()  # the holder's client leaves: its whole charge goes, once
    wait_until(lambda: charges(gateway) == ({r: 0 for r in queued}, {r: 0 for r in queued}))


@pytest.mark.parametrize("end", ["retried", "broken", "client gone"])
def test_each_charge_is_released_once_however_the_stream_ends(gateway: Any, end: str) -> None:
    stubs = gateway.state.stubs
    held, rank, prefill, tokens = hold(gateway, "holder")
    other = next(s for s in stubs if s.name != rank)
    gate = threading.Event()
    for stub in stubs:
        stub.behavior.gate = gate
    if end == "retried":  # the other rank fails before any chunk: the request lands on the holder's
        other.behavior.status = 500
    elif end == "broken":
        gate.set()
        for stub in stubs:
            stub.behavior.die_after = 1  # the connection drops after the first chunk
    with httpx.Client(base_url=gateway.state.url, timeout=30) as client:
        for i in range(2):  # each starts on the rank the holder left free
            with client.stream("POST", "/v1/chat/completions", json=body(f"{end} {i}", True)) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                if end == "retried":
                    assert response.headers["x-prefixgate-backend"] == rank
                    queued, _ = charges(gateway)
                    assert queued == {r: prefill if r == rank else 0 for r in queued}
                    gate.set()
                    assert [line for line in lines if line][-1] == "data: [DONE]"
                    gate.clear()
                elif end == "broken":
                    list(lines)  # ends with an SSE error event
                # "client gone": the client closes the stream after its first chunk
    names = [s.name for s in stubs]
    expected = only_held(names, rank, prefill, tokens)
    wait_until(lambda: charges(gateway) == expected, lambda: f"charges {charges(gateway)} != {expected}")
    gate.set()
    held.close()
    wait_until(lambda: charges(gateway) == ({r: 0 for r in names}, {r: 0 for r in names}))


def test_a_whole_answer_keeps_its_prefill_queued_until_it_ends(gateway: Any) -> None:
    held, rank, prefill, tokens = hold(gateway, "whole")
    queued, inflight = charges(gateway)
    assert queued[rank] == prefill > 0 and inflight[rank] == tokens
    with httpx.Client(base_url=gateway.state.url, timeout=30) as client:
        answer = client.post("/v1/chat/completions", json=body("answered", False))
        assert answer.status_code == 200, answer.text
    assert charges(gateway) == only_held(queued, rank, prefill, tokens)
    held.close()
    wait_until(lambda: charges(gateway) == ({r: 0 for r in queued}, {r: 0 for r in queued}))
