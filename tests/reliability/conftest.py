"""Real servers on loopback for the reliability tests: simulated ranks, stub ranks, prefixgate.

Every test runs under a hard deadline: if it hangs, faulthandler dumps every thread's stack and
ends the run, so a hang is a failure with a traceback, never a stuck CI job.
"""

from __future__ import annotations

import faulthandler
import sys
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest

from bench.sim import SimConfig, SimRankServer
from bench.stub_rank import StubBehavior, create_stub_app
from proxy.server import ServerThread
from tests.helpers.gateway import Gateways

#: Seconds one test may take, servers included, before the run is aborted with stack dumps.
TEST_DEADLINE_S = 60.0
SIM_MODEL = "prefixgate-sim"


@pytest.fixture(autouse=True)
def deadline() -> Iterator[None]:
    faulthandler.dump_traceback_later(TEST_DEADLINE_S, exit=True, file=sys.stderr)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def sims() -> Iterator[Callable[..., list[SimRankServer]]]:
    """Start ``n`` fast simulated ranks: ``sims(2)``; all are stopped after the test."""
    started: list[SimRankServer] = []

    def start(n: int = 2, **config: Any) -> list[SimRankServer]:
        config.setdefault("time_scale", 0.001)
        ranks = []
        for _ in range(n):
            rank = SimRankServer(SimConfig(name=f"sim-{len(started)}", **config)).start()
            started.append(rank)
            ranks.append(rank)
        return ranks

    yield start
    for rank in started:
        rank.clear_faults()  # releases hung requests so the servers stop promptly
        rank.stop()


@pytest.fixture
def stubs() -> Iterator[Callable[..., list[tuple[str, StubBehavior, ServerThread]]]]:
    """Start ``n`` stub ranks (they record what they receive): ``stubs(1)`` -> [(name, behavior, server)]."""
    started: list[ServerThread] = []

    def start(n: int = 1, **behavior: Any) -> list[tuple[str, StubBehavior, ServerThread]]:
        out = []
        for _ in range(n):
            b = StubBehavior(**behavior)
            name = f"stub-{len(started)}"
            server = ServerThread(create_stub_app(b, name=name, model=SIM_MODEL)).start()
            started.append(server)
            out.append((name, b, server))
        return out

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def gateway() -> Iterator[Gateways]:
    """Start prefixgate in front of ranks or ``[(name, url), ...]``: ``gateway(ranks, retries=1, ...)``."""
    gateways = Gateways(health_interval=0.2, health_timeout=1.0, policy="round_robin")
    yield gateways
    gateways.stop_all()


def chat(content: str = "hello", stream: bool = False, max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "model": SIM_MODEL,
        "messages": [{"role": "user", "content": content}],
        "stream": stream,
        "max_tokens": max_tokens,
        **extra,
    }


def sse_events(text: str) -> list[Any]:
    """The decoded ``data:`` payloads of an SSE body (``[DONE]`` kept as the string)."""
    events: list[Any] = []
    for block in text.split("\n\n"):
        for line in block.splitlines():
            if line.startswith("data:"):
                payload = line[5:].strip()
                events.append(payload if payload == "[DONE]" else orjson.loads(payload))
    return events


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    return error
