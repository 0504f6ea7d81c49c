"""With KV events and replicas on one Redis, ``/metrics`` says which replica writes each rank's
mirror to the shared index (it holds the rank's lease): exactly one replica per event-fed rank."""

from __future__ import annotations

import re

import httpx

from tests.helpers.gateway import Gateways
from tests.helpers.ranks import RankServers
from tests.helpers.redis_server import RedisServer
from tests.helpers.wait import wait_until


def writer_gauges(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {
        rank: float(v)
        for rank, v in re.findall(r'prefixgate_kv_event_writer\{backend="([^"]+)"\} (\S+)', text)
    }


def test_each_event_fed_rank_has_one_writer_among_the_replicas(
    rank_servers: RankServers, gateway: Gateways, redis_server: RedisServer
) -> None:
    ranks = rank_servers.sim(2, kv_tokens=200_000, kv_events=True)
    replicas = [gateway(ranks, redis_url=redis_server.url, kv_events="auto") for _ in range(2)]
    served: set[str] = set()
    n = 0
    while served != {rank.name for rank in ranks}:  # events from each rank, through both replicas
        assert n < 40, f"40 new sessions all went to {served}"
        system = f"You are agent {n}, a careful one. " * 40  # no shared head: spread by hash
        body = {
            "model": "sim",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "go"}],
        }
        answer = httpx.post(
            replicas[n % 2].url + "/v1/chat/completions",
            json=body,
            headers={"x-session-id": f"s{n}"},
            timeout=30,
        )
        assert answer.status_code == 200, answer.text
        served.add(answer.headers["x-prefixgate-backend"])
        n += 1

    def one_writer_each() -> bool:
        gauges = [writer_gauges(r.url) for r in replicas]
        return all(sum(g.get(rank.name, 0.0) for g in gauges) == 1.0 for rank in ranks)

    wait_until(
        one_writer_each, lambda: f"one lease holder per rank: {[writer_gauges(r.url) for r in replicas]}"
    )
    for replica in replicas:  # every replica exports the gauge of every rank, 1 or 0
        assert set(writer_gauges(replica.url)) == {rank.name for rank in ranks}


def test_no_writer_gauge_without_kv_events(
    rank_servers: RankServers, gateway: Gateways, redis_server: RedisServer
) -> None:
    ranks = rank_servers.sim(1)
    replica = gateway(ranks, redis_url=redis_server.url)
    assert writer_gauges(replica.url) == {}
