"""Fault knobs, at start-up and at run time (``set_faults`` and ``POST /sim/faults``)."""

from __future__ import annotations

import httpx
import orjson
import pytest

from bench.sim import FaultConfig, SimRankServer
from tests.helpers.ranks import RankServers

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def test_error_rate_gives_openai_error_body(sim: SimRankServer) -> None:
    r = httpx.post(f"{sim.url}/sim/faults", json={"error_rate": 1.0})
    assert r.json()["error_rate"] == 1.0
    err = httpx.post(f"{sim.url}/v1/chat/completions", json=BODY, timeout=5)
    assert err.status_code == 500
    assert set(err.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.post(f"{sim.url}/sim/faults", json={"no_such_knob": 1}).status_code == 400
    sim.clear_faults()
    assert httpx.post(f"{sim.url}/v1/chat/completions", json=BODY, timeout=5).status_code == 200


def test_die_mid_stream_after_n_chunks(sim: SimRankServer) -> None:
    sim.set_faults(die_after_chunks=3)
    received: list[bytes] = []
    with (
        pytest.raises(httpx.RemoteProtocolError),
        httpx.stream("POST", f"{sim.url}/v1/chat/completions", json={**BODY, "stream": True}, timeout=5) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                received.append(line.encode())
    assert len(received) == 3
    assert all(b"[DONE]" not in x for x in received)
    sim.set_faults(die_after_chunks=0)
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(f"{sim.url}/v1/chat/completions", json=BODY, timeout=5)
    # the dropped requests released their blocks
    assert sim.call(lambda rank: rank.pool.usage()) == 0


def test_hang_until_cleared(sim: SimRankServer) -> None:
    sim.set_faults(hang=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{sim.url}/v1/chat/completions", json=BODY, timeout=0.3)
    sim.set_faults(hang=False)
    assert httpx.post(f"{sim.url}/v1/chat/completions", json=BODY, timeout=5).status_code == 200


def test_refuse_connections_then_listen_again(sim: SimRankServer) -> None:
    with httpx.Client(timeout=5) as client:
        assert client.get(f"{sim.url}/health").status_code == 200  # a pooled keep-alive connection
        client.post(f"{sim.url}/sim/faults", json={"refuse_connections": True})
        with pytest.raises(httpx.ConnectError):
            client.get(f"{sim.url}/health")
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{sim.url}/health", timeout=2)
    sim.set_faults(refuse_connections=False)
    assert httpx.get(f"{sim.url}/health", timeout=5).status_code == 200


def test_malformed_sse_and_startup_latency(rank_servers: RankServers) -> None:
    (s,) = rank_servers.sim(1, num_blocks=64, faults=FaultConfig(malformed_sse=True, latency_s=0.01))
    r = httpx.post(f"{s.url}/v1/chat/completions", json={**BODY, "stream": True}, timeout=5)
    bad = 0
    for event in r.text.split("\n\n"):
        if event.startswith("data: ") and event != "data: [DONE]":
            try:
                orjson.loads(event[6:])
            except orjson.JSONDecodeError:
                bad += 1
    assert bad == 1
