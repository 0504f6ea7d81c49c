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

from tests.helpers.redis_server import RedisServer  # noqa: E402  (needs ROOT on sys.path)


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
