"""The replica tests on the Redis topologies users run: a three-master Redis Cluster and a master
watched by Sentinel (``routing/redis_topology.py``), each started on loopback ports by the test.
Valkey is not packaged by this OS, so it is not among them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.sim import SimConfig
from tests.admission.conftest import KV_TOKENS
from tests.admission.test_shared_admission import (
    replicas_keep_each_rank_within_its_budget,
    replicas_keep_each_rank_within_its_session_cap,
)
from tests.helpers.gateway import Gateways
from tests.helpers.ranks import RankServers
from tests.helpers.redis_server import RedisClusterServers, RedisSentinelServers
from tests.replicas.test_balanced import a_session_dealt_across_replicas_keeps_one_rank
from tests.routing.test_redis_event_writer import an_event_is_written_to_redis_by_one_replica, replicas_on

TOPOLOGIES = {"cluster": RedisClusterServers, "sentinel": RedisSentinelServers}


@pytest.fixture(params=sorted(TOPOLOGIES))
def topology_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The ``--redis-url`` of a freshly started Redis Cluster or Sentinel setup."""
    servers = TOPOLOGIES[request.param]().start()
    yield servers.url
    servers.stop()


@pytest.fixture
def sim_config() -> SimConfig:
    """Simulated ranks with the admission tests' tiny pools (two 700-token sessions fit each)."""
    return SimConfig(kv_tokens=KV_TOKENS, time_scale=0)


def test_a_session_dealt_across_replicas_keeps_one_rank(
    rank_servers: RankServers, gateway: Gateways, topology_url: str
) -> None:
    a_session_dealt_across_replicas_keeps_one_rank(rank_servers, gateway, topology_url)


def test_replicas_admitting_at_once_keep_each_rank_within_its_budget(
    rank_servers: RankServers, topology_url: str
) -> None:
    replicas_keep_each_rank_within_its_budget(rank_servers, topology_url)


def test_replicas_admitting_at_once_keep_each_rank_within_its_session_cap(
    rank_servers: RankServers, topology_url: str
) -> None:
    replicas_keep_each_rank_within_its_session_cap(rank_servers, topology_url)


def test_an_event_fed_rank_is_written_to_redis_by_one_replica(topology_url: str) -> None:
    with replicas_on(topology_url) as stores:
        an_event_is_written_to_redis_by_one_replica(stores)
