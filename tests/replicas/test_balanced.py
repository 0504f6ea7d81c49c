"""Replicas behind a real load balancer that deals requests in turn: a session's consecutive requests
reach different replicas, which share its record and its rank through Redis."""

from __future__ import annotations

import re

import httpx

from tests.helpers.balancer import Balancer
from tests.helpers.gateway import Gateways
from tests.helpers.ranks import RankServers
from tests.helpers.redis_server import RedisServer
from tests.helpers.wait import wait_until


def answered(url: str) -> int:
    """Completions this replica answered (its own ``prefixgate_requests_total``)."""
    text = httpx.get(url + "/metrics").text
    pattern = (
        r'prefixgate_requests_total\{backend="[^"]+",endpoint="/v1/chat/completions",status="200"\} (\S+)'
    )
    return int(sum(float(v) for v in re.findall(pattern, text)))


def test_a_session_dealt_across_replicas_keeps_one_record_and_one_rank(
    rank_servers: RankServers, gateway: Gateways, redis_server: RedisServer
) -> None:
    a_session_dealt_across_replicas_keeps_one_rank(rank_servers, gateway, redis_server.url)


def a_session_dealt_across_replicas_keeps_one_rank(
    rank_servers: RankServers, gateway: Gateways, redis_url: str
) -> None:
    """Two replicas on ``redis_url`` behind a balancer dealing requests in turn: one session's
    eight turns reach both, yet one rank serves them all and both see one record."""
    ranks = rank_servers.sim(2)
    replicas = [gateway(ranks, redis_url=redis_url) for _ in range(2)]
    with Balancer([r.url for r in replicas]) as balancer:
        history = [{"role": "system", "content": "You are a careful agent. " * 60}]
        placed = set()
        for turn in range(8):
            history.append({"role": "user", "content": f"step {turn}: go on"})
            body = {"model": "sim", "messages": history, "max_tokens": 8}
            answer = httpx.post(
                balancer.url + "/v1/chat/completions", json=body, headers={"x-session-id": "lb-1"}
            )
            assert answer.status_code == 200
            placed.add(answer.headers["x-prefixgate-backend"])
            history.append(answer.json()["choices"][0]["message"])
        assert [answered(r.url) for r in replicas] == [4, 4]  # dealt in turn
        assert len(placed) == 1  # yet one rank served the whole session
        for replica in replicas:  # and every replica sees the same record, once the last save
            # behind has landed (proxy/state/redis/sessions.py: a queue's wait after the answer)
            record = replica.url + "/admin/sessions/lb-1"
            wait_until(
                lambda record=record: httpx.get(record).json()["turns"] == 8,
                lambda record=record: f"{record}: {httpx.get(record).json()['turns']} turns",
            )
