"""Fixtures for the session and admission tests: simulated ranks with tiny pools, proxies, Redis."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import httpx
import pytest

from bench.sim import SimConfig
from proxy.state.redis.sessions import RedisSessionStore
from tests.helpers.gateway import Gateways
from tests.helpers.redis_server import RedisServer

#: A rank's pool: two 700-token sessions fit its 0.8 budget (1,638 tokens), a third does not.
KV_TOKENS = 2048


@pytest.fixture
def sim_config() -> SimConfig:
    """``rank_servers.sim(n)``: simulated ranks with instant timing and ``KV_TOKENS`` pools."""
    return SimConfig(kv_tokens=KV_TOKENS, time_scale=0)


def replica(server: RedisServer) -> RedisSessionStore:
    """A session store of its own (its own client, link and thread), as another replica has."""
    return RedisSessionStore(server.url, socket_timeout=1.0)


@pytest.fixture
def gateway() -> Iterator[Gateways]:
    """Start prefixgate in front of sim ranks: ``gateway(ranks, admission_wait=0.2)``."""
    gateways = Gateways(health_interval=0.5)
    yield gateways
    gateways.stop_all()


def prompt_of(session: str, tokens: int) -> str:
    """A user message of about ``tokens`` tokens, distinct per session (no shared prefix)."""
    return f"{session}: " + "data " * tokens


def chat(
    url: str, session: str, tokens: int, headers: dict[str, str] | None = None, timeout: float = 20.0
) -> httpx.Response:
    body = {
        "model": "sim",
        "messages": [{"role": "user", "content": prompt_of(session, tokens)}],
        "max_tokens": 16,
    }
    return httpx.post(
        url + "/v1/chat/completions",
        json=body,
        headers={"x-session-id": session, **(headers or {})},
        timeout=timeout,
    )


class Background:
    """A request run in a thread, so the test can watch the proxy while it waits."""

    def __init__(self, fn: Callable[[], httpx.Response]) -> None:
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], httpx.Response]) -> None:
        try:
            self.response = fn()
        except BaseException as exc:  # reported by result()
            self.error = exc

    def result(self, timeout: float = 20.0) -> httpx.Response:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "request did not finish"
        if self.error is not None:
            raise self.error
        assert self.response is not None
        return self.response


def metric(url: str, name: str, headers: dict[str, str] | None = None, **labels: str) -> float | None:
    """The value of one sample on ``/metrics`` (None when absent)."""
    text = httpx.get(url + "/metrics", headers=headers, timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    series = f"{name}{{{want}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None
