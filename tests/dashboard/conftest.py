"""Fixtures for the dashboard tests: simulated ranks, prefixgate in front, agent-shaped traffic."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from bench.sim import SimConfig, SimRankServer
from proxy.server import ServerThread
from tests.helpers.gateway import gateway_app
from tests.helpers.ranks import RankServers

SYSTEM = "You are a coding agent. Use the tools to read and edit files. " * 20


@dataclass
class Deployment:
    ranks: list[SimRankServer]
    server: ServerThread
    app: Any

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def gateway(self) -> Any:
        return self.app.state.gateway


@pytest.fixture
def sim_config() -> SimConfig:
    """The deployments' simulated ranks: instant timing, 65,536-token pools."""
    return SimConfig(time_scale=0, kv_tokens=65_536)


@pytest.fixture
def deployment(rank_servers: RankServers) -> Iterator[Callable[..., Deployment]]:
    """``deployment(ranks=2, **prefixgate options)``: sim ranks (time_scale 0) and prefixgate before them."""
    started: list[Deployment] = []

    def start(ranks: int = 2, api_keys: list[str] | None = None, **options: Any) -> Deployment:
        fleet = rank_servers.sim(ranks)
        options.setdefault("health_interval", 0.5)
        app = gateway_app(fleet, api_keys, **options)
        server = ServerThread(app).start()
        dep = Deployment(fleet, server, app)
        started.append(dep)
        return dep

    yield start
    for dep in started:
        dep.server.stop()  # the ranks stop after, with rank_servers


def converse(
    url: str, session: str, turns: int, headers: dict[str, str] | None = None, system: str = SYSTEM
) -> list[httpx.Response]:
    """A session of ``turns`` growing turns (each re-sends the history, as agents do)."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    answers = []
    with httpx.Client(timeout=20.0, trust_env=False) as client:
        for turn in range(turns):
            messages.append({"role": "user", "content": f"step {turn} of {session}: list the files " * 8})
            response = client.post(
                url + "/v1/chat/completions",
                json={"model": "sim", "messages": messages, "max_tokens": 8},
                headers={"x-session-id": session, **(headers or {})},
            )
            response.raise_for_status()
            answers.append(response)
            answer = response.json()["choices"][0]["message"]["content"]
            messages.append({"role": "assistant", "content": answer})
    return answers
