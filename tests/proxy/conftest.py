"""prefixgate before stub ranks (``rank_servers.stub``, tests/conftest.py) for the forwarding tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.gateway import Gateways


@pytest.fixture
def proxy() -> Iterator[Gateways]:
    """Start prefixgate in front of the given ranks: ``proxy(ranks, retries=0)``."""
    # These suites test forwarding mechanics; round robin makes where traffic goes predictable.
    # The default policy (prefix_affinity) is tested end to end in tests/routing.
    gateways = Gateways(policy="round_robin", health_interval=0.2, health_timeout=1.0)
    yield gateways
    gateways.stop_all()
