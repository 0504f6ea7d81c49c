"""Real servers on loopback for the reliability tests: simulated and stub ranks (``rank_servers``,
tests/conftest.py) with this suite's defaults, prefixgate.

Every test runs under a hard deadline: if it hangs, faulthandler dumps every thread's stack and
ends the run, so a hang is a failure with a traceback, never a stuck CI job.
"""

from __future__ import annotations

import faulthandler
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from bench.sim import SimConfig
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
def sim_config() -> SimConfig:
    """Fast simulated ranks (model time x 0.001): ``rank_servers.sim(2)``."""
    return SimConfig(time_scale=0.001)


@pytest.fixture
def stub_model() -> str:
    """Stub ranks (``rank_servers.stub(1)``) serve the simulated ranks' model."""
    return SIM_MODEL


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


def post_turns(url: str, text: str, session: str, turns: int = 2) -> None:
    """``turns`` chat turns of one session (``text`` and the turn's number), each answered 200."""
    for turn in range(turns):
        answer = httpx.post(
            url + "/v1/chat/completions",
            json=chat(text + f"turn {turn}"),
            headers={"x-session-id": session},
            timeout=15,
        )
        assert answer.status_code == 200, answer.text


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
