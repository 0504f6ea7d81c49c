"""A new state backend is one module plus one registration line: this file is that module.

``CountingState`` keeps everything in this process like ``memory`` and counts what the session
table stores through it; ``--state counting`` selects it once registered."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import pytest

from bench.sim import SimConfig, start_fleet, stop_fleet
from proxy.config import Settings
from proxy.state import backends as state
from proxy.state.memory import MemorySessionStore, MemoryState
from proxy.state.sessions import Session, SessionStore
from routing.index import PrefixIndex
from tests.helpers.gateway import start_gateway

SAVED: list[str] = []


class CountingStore(MemorySessionStore):
    def save(self, session: Session) -> None:
        SAVED.append(session.key)
        super().save(session)


class CountingState(MemoryState):
    name = "counting"

    def sessions(self) -> SessionStore:
        return CountingStore()

    def prefix_index(
        self, model: str, block_size: int, hash_algo: str, on_state: Callable[[bool], None]
    ) -> PrefixIndex:
        return super().prefix_index(model, block_size, hash_algo, on_state)


@pytest.fixture
def counting_state() -> Iterator[None]:
    state.BACKENDS["counting"] = lambda settings: CountingState()  # the one registration line
    yield
    del state.BACKENDS["counting"]


def test_a_registered_state_backend_holds_the_sessions(counting_state: None) -> None:
    assert state.backend_name(Settings(state="counting")) == "counting"
    ranks = start_fleet(1, SimConfig(time_scale=0))
    proxy = start_gateway(ranks, state="counting", health_interval=0.5)
    try:
        body = {"model": "sim", "messages": [{"role": "user", "content": "hello " * 50}], "max_tokens": 4}
        answer = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers={"x-session-id": "toy-s"})
        assert answer.status_code == 200
        assert "toy-s" in SAVED
        assert httpx.get(proxy.url + "/admin/sessions/toy-s").json()["turns"] == 1
    finally:
        proxy.stop()
        stop_fleet(ranks)


def test_an_unknown_state_backend_is_a_configuration_error() -> None:
    from proxy.config import ConfigError

    with pytest.raises(ConfigError, match="unknown state backend 'nowhere'"):
        state.open_state(Settings(state="nowhere"))
    with pytest.raises(ConfigError, match="needs --redis-url"):
        state.open_state(Settings(state="redis"))
