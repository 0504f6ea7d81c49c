"""Fixtures: simulated vLLM ranks, prefixgate in front of them, and an agent-like conversation."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import httpx
import pytest

from bench.sim import SimConfig, SimRankServer
from proxy.gateway import Gateway
from proxy.server import ServerThread
from tests.helpers.gateway import gateway_app
from tests.helpers.ranks import RankServers
from tests.helpers.real_vllm import path_tool

SIM = replace(SimConfig(), time_scale=0.001, kv_tokens=65_536)


@dataclass
class Prefixgate:
    server: ServerThread
    gateway: Gateway
    ranks: list[SimRankServer]

    @property
    def url(self) -> str:
        return self.server.url

    def chat(self, session: str, body: dict[str, Any], **headers: str) -> httpx.Response:
        response = httpx.post(
            self.url + "/v1/chat/completions",
            json=body,
            headers={"x-session-id": session, **headers},
            timeout=10.0,
        )
        assert response.status_code == 200, response.text
        return response

    def breaks(self, response: httpx.Response) -> list[dict[str, Any]]:
        """The breaks recorded so far for the session ``response`` belongs to."""
        return self.gateway.explainer.breaks(response.headers["x-prefixgate-session"])

    def rank(self, name: str) -> SimRankServer:
        return next(r for r in self.ranks if r.name == name)


@pytest.fixture
def sim_config() -> SimConfig:
    return SIM


@pytest.fixture
def prefixgate(rank_servers: RankServers) -> Iterator[Callable[..., Prefixgate]]:
    """``prefixgate(ranks=2, **options)``: a fresh fleet of simulated ranks with prefixgate in front."""
    servers: list[ServerThread] = []

    def start(ranks: int = 2, **options: Any) -> Prefixgate:
        fleet = rank_servers.sim(ranks)
        options.setdefault("health_interval", 0.2)
        options.setdefault("log_level", "warning")
        app = gateway_app(fleet, **options)
        server = ServerThread(app).start()
        servers.append(server)
        return Prefixgate(server, app.state.gateway, fleet)

    yield start
    for server in servers:
        server.stop()  # the ranks stop after, with rank_servers


def tool(name: str, description: str) -> dict[str, Any]:
    return path_tool(name, description, "A file path.")


TOOLS = [
    tool("read_file", "Reads a file of the repository and returns its text with line numbers."),
    tool("write_file", "Writes a whole file; creates the parent directories when needed."),
    tool("run_tests", "Runs the test suite of the repository and returns the failures."),
    tool("search", "Searches the repository for a regular expression and lists the matching lines."),
]


def system_prompt(tag: str) -> str:
    lines = [f"You are a coding agent working in the repository of project {tag}."]
    lines += [
        f"Rule {i}: read the code before changing it, keep the change small, run the tests, report."
        for i in range(1, 25)
    ]
    return "\n".join(lines)


class Conversation:
    """An agent session: each ``turn()`` re-sends the whole history plus the new user message."""

    def __init__(self, tag: str) -> None:
        self.system = system_prompt(tag)
        self.tools = copy.deepcopy(TOOLS)
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": self.system}]
        self.extra: dict[str, Any] = {}
        self.turns = 0

    def turn(self, user: str | None = None) -> dict[str, Any]:
        if self.turns:
            self.messages.append({"role": "assistant", "content": f"Done with step {self.turns}."})
        self.turns += 1
        self.messages.append(
            {"role": "user", "content": user or f"Step {self.turns}: fix the next failing test."}
        )
        return self.body()

    def body(self) -> dict[str, Any]:
        return {
            "model": SIM.model,
            "messages": copy.deepcopy(self.messages),
            "tools": copy.deepcopy(self.tools),
            "max_tokens": 4,
            **copy.deepcopy(self.extra),
        }
