"""Fixtures shared by the test suites: real servers on loopback, started and stopped per test."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.sim import SimConfig  # noqa: E402  (needs ROOT on sys.path)
from tests.helpers.ranks import RankServers  # noqa: E402
from tests.helpers.redis_server import RedisServer  # noqa: E402


@pytest.fixture
def shared_dir() -> Path:
    """../shared from the project root; tests that need it skip loudly when it is absent."""
    if not SHARED.is_dir():
        pytest.skip(f"shared material not found at {SHARED}")
    return SHARED


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, killed after the test."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def sim_config() -> SimConfig:
    """The configuration of the simulated ranks ``rank_servers.sim`` starts: no model time. A suite
    overrides this fixture in its conftest.py; a call's keyword arguments override it in turn."""
    return SimConfig(time_scale=0)


@pytest.fixture
def stub_model() -> str | None:
    """The model ``rank_servers.stub`` ranks serve; None: ``model-<index>``. A suite may override it."""
    return None


@pytest.fixture
def rank_servers(sim_config: SimConfig, stub_model: str | None) -> Iterator[RankServers]:
    """``rank_servers.sim(n, **config)`` / ``rank_servers.stub(n, **behavior)``: ranks on free loopback
    ports (``tests/helpers/ranks.py``), every one stopped after the test."""
    with RankServers(sim_config, stub_model) as servers:
        yield servers
