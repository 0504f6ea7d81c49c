"""The Redis a ``--redis-url`` names: one server, a master watched by Sentinel, or a Redis Cluster.

- ``redis://[[user]:password@]host:port/db``, ``rediss://...`` (TLS), ``unix:///path?db=N``: one server.
- ``redis+sentinel://[[user]:password@]host:port[,host:port...]/SERVICE[/db]`` (``rediss+sentinel``
  for TLS): the master the sentinels name for ``SERVICE``, asked again after a failover; the
  credentials are the master's (the sentinels are asked without).
- ``redis+cluster://[[user]:password@]host:port[,host:port...]`` (``rediss+cluster``): a Redis
  Cluster, discovered from any of the nodes given.

In a cluster one script (and one atomic step) may only touch keys of one hash slot, so each store
puts its keys under one hash tag there (``slot_prefix``): a store's keys then live on one master,
and the cluster gives availability rather than spreading one store over its masters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry
from redis.sentinel import Sentinel

SENTINEL_SCHEMES = ("redis+sentinel", "rediss+sentinel")
CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SCHEMES = ("redis", "rediss", "unix", *SENTINEL_SCHEMES, *CLUSTER_SCHEMES)
#: The URLs ``parse`` takes, written once (``--redis-url``'s help; docs/deploying.md says the same): each
#: form and what it names.
REDIS_URLS = {
    "redis://[[user]:password@]host:port/db": "one server; rediss:// for TLS, unix:///path?db=N",
    "redis+sentinel://[[user]:password@]host:port[,host:port...]/SERVICE[/db]": "Sentinel",
    "redis+cluster://[[user]:password@]host:port[,host:port...]": "Redis Cluster; rediss+ for TLS",
}
REDIS_URL_FORMS = ", ".join(f"{url} ({what})" for url, what in REDIS_URLS.items())


def reply_text(reply: object) -> str:
    """A Redis reply as text: the clients here do not decode responses, so a string arrives as bytes."""
    return reply.decode() if isinstance(reply, bytes) else str(reply)


@dataclass(frozen=True, slots=True)
class Topology:
    """A Sentinel or Cluster URL, parsed."""

    kind: str  # "sentinel" | "cluster"
    nodes: tuple[tuple[str, int], ...]
    username: str | None
    password: str | None
    tls: bool
    service: str | None
    db: int


def parse(url: str) -> Topology | None:
    """The topology of a Sentinel or Cluster URL (``ValueError`` when malformed); None for a URL of
    one server, which redis-py reads itself."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SENTINEL_SCHEMES + CLUSTER_SCHEMES:
        return None
    kind = "sentinel" if scheme in SENTINEL_SCHEMES else "cluster"
    netloc, _, path = rest.partition("/")
    credentials, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = credentials.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    nodes = []
    for node in hosts.split(","):
        host, colon, port = node.strip().rpartition(":")
        if not colon or not host or not port.isdigit():
            raise ValueError(f"{scheme}:// needs host:port nodes separated by commas, got {node!r}")
        nodes.append((host.strip("[]"), int(port)))
    parts = [p for p in path.split("/") if p]
    service = None
    db = 0
    if kind == "sentinel":
        if not parts:
            raise ValueError(
                f"{scheme}:// needs the master's service name: {scheme}://host:port/SERVICE[/db]"
            )
        service = parts.pop(0)
    if parts:
        if not parts[0].isdigit() or len(parts) > 1:
            raise ValueError(f"{scheme}:// ends with the database number, got {'/'.join(parts)!r}")
        db = int(parts[0])
    if kind == "cluster" and db:
        raise ValueError("a Redis Cluster has database 0 only")
    return Topology(kind, tuple(nodes), username, password, scheme.startswith("rediss"), service, db)


def fail_fast(url: str, timeout: float) -> Any:
    """A client of ``url``'s Redis whose every call is one attempt of at most ``timeout`` seconds
    (redis-py would otherwise retry with backoff, and a hung Redis held each call for seconds)."""
    common: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    topology = parse(url)
    if topology is None:
        return redis.Redis.from_url(url, **common)
    auth: dict[str, Any] = {"username": topology.username, "password": topology.password}
    if topology.kind == "cluster":
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in topology.nodes],
            ssl=topology.tls,
            **auth,
            **common,
        )
    sentinel = Sentinel(
        list(topology.nodes),
        sentinel_kwargs={"socket_timeout": timeout, "socket_connect_timeout": timeout, "ssl": topology.tls},
        ssl=topology.tls,
        **common,
    )
    assert topology.service is not None
    return sentinel.master_for(topology.service, db=topology.db, **auth, **common)


def is_cluster(client: Any) -> bool:
    return isinstance(client, RedisCluster)


def slot_prefix(prefix: str, client: Any) -> str:
    """``prefix`` as a hash tag on a cluster (every key under it in one slot), else as it is."""
    return f"{{{prefix}}}" if is_cluster(client) else prefix


class ScriptBatch:
    """Script calls (and commands) batched into one pipeline where the client allows it; sent one
    by one on a cluster, whose redis-py pipelines refuse scripts (only resynchronizations batch
    scripts, so a cluster pays one round trip per record there and nowhere else)."""

    def __init__(self, client: Any) -> None:
        self._direct = is_cluster(client)
        #: What to pass as a script's ``client`` (and to call commands on).
        self.target: Any = client if self._direct else client.pipeline(transaction=False)

    def execute(self) -> None:
        if not self._direct:
            self.target.execute()
