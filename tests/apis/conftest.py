"""Simulated ranks and prefixgate (default policy) for the agent-API tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.sim import SimConfig
from tests.helpers.gateway import Gateways


@pytest.fixture
def sim_config() -> SimConfig:
    """``rank_servers.sim(n)``: simulated ranks with instant timing and 200,000-token pools."""
    return SimConfig(time_scale=0, kv_tokens=200_000)


@pytest.fixture
def gateway() -> Iterator[Gateways]:
    """``gateway(ranks, **flags)``: prefixgate with its defaults in front of ``ranks``."""
    gateways = Gateways(health_interval=0.2, health_timeout=1.0)
    yield gateways
    gateways.stop_all()
