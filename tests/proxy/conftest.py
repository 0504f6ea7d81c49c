from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from bench.stub_rank import StubBehavior, create_stub_app
from proxy.server import ServerThread
from tests.helpers.gateway import Gateways


@dataclass
class StubRank:
    name: str
    behavior: StubBehavior
    server: ServerThread
    app: Any

    @property
    def url(self) -> str:
        return self.server.url

    def stop(self) -> None:
        self.server.stop()

    def restart(self) -> None:
        """Serve again on the same port (after ``stop``)."""
        self.server = ServerThread(self.app, port=self.server.port).start()


@pytest.fixture
def stub_ranks() -> Iterator[Callable[..., list[StubRank]]]:
    """Start ``n`` stub ranks: ``stub_ranks(2)``; all are stopped after the test."""
    started: list[StubRank] = []

    def start(n: int = 1, **behavior: Any) -> list[StubRank]:
        ranks = []
        for _ in range(n):
            b = StubBehavior(**behavior)
            name = f"stub-{len(started)}"
            app = create_stub_app(b, name=name, model=f"model-{len(started)}")
            rank = StubRank(name, b, ServerThread(app).start(), app)
            started.append(rank)
            ranks.append(rank)
        return ranks

    yield start
    for rank in started:
        if rank.behavior.gate is not None:
            rank.behavior.gate.set()
        rank.stop()


@pytest.fixture
def proxy() -> Iterator[Gateways]:
    """Start prefixgate in front of the given ranks: ``proxy(ranks, retries=0)``."""
    # These suites test forwarding mechanics; round robin makes where traffic goes predictable.
    # The default policy (prefix_affinity) is tested end to end in tests/routing.
    gateways = Gateways(policy="round_robin", health_interval=0.2, health_timeout=1.0)
    yield gateways
    gateways.stop_all()
