"""A small trace replayed through prefixgate replicas: N ``prefixgate serve --redis-url`` processes
sharing one Redis of a given topology, behind HAProxy dealing requests in turn (so a session's
consecutive requests reach different replicas), in front of a fresh fleet of simulated ranks in a
process of its own. The replay is lockstep (``tests/helpers/lockstep.py``): one request at a time,
in an order the trace alone fixes, so what a run shows is what the replicas do."""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import redis as redis_client

from bench.common import metric_totals
from bench.replay import ReplayResult, TraceReplayConfig
from bench.systems import FleetConfig, SimFleetProcess
from bench.traces import TraceSession
from proxy.state.redis.embedded import EmbeddedRedis
from tests.helpers.balancer import Balancer
from tests.helpers.gateway import proxy_process
from tests.helpers.lockstep import replay_lockstep
from tests.helpers.redis_server import RedisClusterServers, RedisSentinelServers

#: The Redis topologies the replicas may share: one server, three masters in a Redis Cluster, a
#: master watched by Sentinel; each on loopback, started fresh for each replay.
TOPOLOGIES = ("server", "cluster", "sentinel")
RANKS = 4


@dataclass(frozen=True, slots=True)
class ReplicaReplay:
    """What one replay through the replicas gave."""

    result: ReplayResult
    #: Requests the trace holds (every session's, sub-agents included).
    requests_sent: int
    #: Commands Redis ran, per command, summed over the topology's masters (``INFO commandstats``).
    redis_commands: dict[str, int]
    #: KV events the replicas applied to their mirrors and faults their feeds met (``kv_events``).
    kv_events_applied: float
    kv_event_faults: float

    def sessions_on_two_ranks(self) -> int:
        """Sessions whose requests were served by more than one rank."""
        ranks_of: dict[str, set[str]] = defaultdict(set)
        for turn in self.result.turns:
            ranks_of[turn.session].add(turn.rank)
        return sum(1 for ranks in ranks_of.values() if len(ranks) > 1)


def _redis(topology: str) -> EmbeddedRedis | RedisClusterServers | RedisSentinelServers:
    if topology == "cluster":
        return RedisClusterServers()
    if topology == "sentinel":
        return RedisSentinelServers()
    return EmbeddedRedis()


def _commands(node_urls: Sequence[str]) -> dict[str, int]:
    calls: dict[str, int] = defaultdict(int)
    for url in node_urls:
        client = redis_client.Redis.from_url(url)
        try:
            stats = client.info("commandstats")
        finally:
            client.close()
        for name, value in stats.items():
            calls[name.removeprefix("cmdstat_")] += int(value["calls"])
    return dict(calls)


def _kv_event_totals(urls: Sequence[str]) -> dict[str, float]:
    names = ("prefixgate_kv_events", "prefixgate_kv_event_faults")
    totals = dict.fromkeys(names, 0.0)
    for url in urls:
        with contextlib.suppress(httpx.HTTPError):
            for name, value in metric_totals(url, names).items():
                totals[name] += value
    return totals


def replay_through_replicas(
    sessions: list[TraceSession],
    topology: str,
    *,
    replicas: int = 2,
    kv_tokens: int = 100_000,
    kv_events: bool = False,
    concurrency: int = 4,
    think_scale: float = 0.01,
) -> ReplicaReplay:
    """Replay ``sessions`` through ``replicas`` prefixgate processes on a fresh Redis of ``topology``
    (``TOPOLOGIES``) behind HAProxy, before ``RANKS`` simulated ranks with no model time; with
    ``kv_events`` the ranks publish KV events and every replica subscribes (``--kv-events auto``)."""
    fleet_config = FleetConfig(ranks=RANKS, kv_tokens=kv_tokens, time_scale=0.0, kv_events=kv_events)
    with contextlib.ExitStack() as stack:
        fleet = stack.enter_context(SimFleetProcess(fleet_config))
        specs = [f"sim-{i}={url}" for i, url in enumerate(fleet.urls)]
        redis = _redis(topology)
        stack.enter_context(redis)
        flags = ["--redis-url", redis.url, *(["--kv-events", "auto"] if kv_events else [])]
        urls = []
        for _ in range(replicas):
            proxy, url = proxy_process(specs, extra=flags)
            stack.enter_context(proxy)
            urls.append(url)
        balancer = stack.enter_context(Balancer(urls))
        config = TraceReplayConfig(fleet_config.model, concurrency=concurrency, time_scale=think_scale)
        result = asyncio.run(replay_lockstep(balancer.url, sessions, config))
        events = _kv_event_totals(urls) if kv_events else {}
        masters = [redis.url] if isinstance(redis, EmbeddedRedis) else redis.node_urls
        commands = _commands(masters)
    return ReplicaReplay(
        result=result,
        requests_sent=sum(len(s.requests) for top in sessions for s in top.all_sessions()),
        redis_commands=commands,
        kv_events_applied=events.get("prefixgate_kv_events", 0.0),
        kv_event_faults=events.get("prefixgate_kv_event_faults", 0.0),
    )
