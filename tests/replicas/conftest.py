"""Fixtures for the replica tests: prefixgate processes in front of test ranks."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.gateway import Gateways


@pytest.fixture
def gateway() -> Iterator[Gateways]:
    """Start prefixgate in front of the given ranks: ``gateway(ranks, **flags)``."""
    gateways = Gateways(health_interval=0.5)
    yield gateways
    gateways.stop_all()
