"""``--redis-url`` forms: one server, Sentinel, Redis Cluster (``proxy/state/redis/topology.py``)."""

from __future__ import annotations

import pytest
from redis.cluster import RedisCluster

from proxy.config import ConfigError, load_settings
from proxy.state.redis.check import redact
from proxy.state.redis.topology import Topology, fail_fast, parse, slot_prefix


def test_sentinel_and_cluster_urls_are_parsed() -> None:
    assert parse("redis+sentinel://:s3cret@10.0.0.1:26379,10.0.0.2:26380/mymaster/2") == Topology(
        "sentinel", (("10.0.0.1", 26379), ("10.0.0.2", 26380)), None, "s3cret", False, "mymaster", 2
    )
    assert parse("rediss+cluster://app:pw@a:7000,b:7001") == Topology(
        "cluster", (("a", 7000), ("b", 7001)), "app", "pw", True, None, 0
    )
    assert parse("redis+sentinel://h:26379/svc") == Topology(
        "sentinel", (("h", 26379),), None, None, False, "svc", 0
    )
    assert parse("redis://h:6379/0") is None  # one server: redis-py reads it


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("redis+sentinel://h:26379", "service name"),
        ("redis+cluster://h", "host:port"),
        ("redis+cluster://h:7000/3", "database 0 only"),
        ("redis+sentinel://h:1/svc/x", "database number"),
    ],
)
def test_malformed_topology_urls_are_refused_at_load(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse(url)
    with pytest.raises(ConfigError, match=problem):
        load_settings(flags={"redis_url": url}, backend_specs=["r=http://127.0.0.1:1"], environ={})


def test_a_cluster_client_tags_each_store_prefix_and_a_server_client_does_not() -> None:
    server = fail_fast("redis://127.0.0.1:1/0", 0.1)
    assert slot_prefix("prefixgate:sessions", server) == "prefixgate:sessions"
    cluster = RedisCluster.__new__(RedisCluster)  # not connected: only its type is looked at
    assert slot_prefix("prefixgate:sessions", cluster) == "{prefixgate:sessions}"


def test_passwords_are_redacted_from_every_form() -> None:
    assert redact("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("rediss://user:pw@h:6380/1") == "rediss://user:***@h:6380/1"
    assert redact("redis+cluster://:pw@a:7000,b:7001") == "redis+cluster://:***@a:7000,b:7001"
    assert redact("redis+sentinel://h:26379/svc") == "redis+sentinel://h:26379/svc"
