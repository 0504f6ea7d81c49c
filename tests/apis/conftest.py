"""Simulated ranks and prefixgate (default policy) for the agent-API tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bench.sim import SimConfig, start_fleet, stop_fleet
from tests.helpers.gateway import Gateways


@pytest.fixture
def fleet() -> Iterator[Callable[..., list[Any]]]:
    """``fleet(n)``: ``n`` simulated ranks with instant timing; stopped after the test."""
    started: list[Any] = []

    def start(n: int = 2, **config: Any) -> list[Any]:
        config.setdefault("kv_tokens", 200_000)
        ranks = start_fleet(n, SimConfig(time_scale=0, **config))
        started.extend(ranks)
        return ranks

    yield start
    stop_fleet(started)


@pytest.fixture
def gateway() -> Iterator[Gateways]:
    """``gateway(ranks, **flags)``: prefixgate with its defaults in front of ``ranks``."""
    gateways = Gateways(health_interval=0.2, health_timeout=1.0)
    yield gateways
    gateways.stop_all()
