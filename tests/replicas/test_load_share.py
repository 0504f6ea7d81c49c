"""Replicas tell each other the load they put on each rank (``proxy/state/load_share.py``): the
prefill queued and the requests in flight, so that routing and admission weigh the whole load, not
the 1/N of it one replica sent."""

from __future__ import annotations

import threading
import time

import httpx
import orjson

from proxy.server import ServerThread
from proxy.stages.route import Router
from proxy.state.load_share import (
    BUSY_INTERVAL_S,
    SHARE_INTERVAL_S,
    STALE_S,
    Load,
    LocalShare,
    share_interval,
)
from proxy.state.redis.link import RedisLink, fail_fast_client
from proxy.state.redis.load_share import DROP_AFTER, RedisShare
from routing.policies import make_policy
from tests.helpers.gateway import gateway_app
from tests.helpers.ranks import RankServers
from tests.helpers.redis_server import RedisServer
from tests.helpers.wait import wait_until
from tests.routing.conftest import chain, make_ctx, make_pool, pick


def shares(server: RedisServer, count: int) -> list[RedisShare]:
    link = RedisLink(fail_fast_client(server.url, 1.0))
    return [RedisShare(link, replica=f"replica-{n}") for n in range(count)]


def prefill(share: RedisShare, queued: dict[str, int]) -> dict[str, int]:
    """``share``'s exchange of ``queued`` prefill (no requests): the others' prefill it reads."""
    return dict(share.exchange(Load(queued)).prefill)


def test_each_replica_reads_the_others_load_summed_per_rank(redis_server: RedisServer) -> None:
    a, b, c = shares(redis_server, 3)
    assert prefill(a, {"r0": 100}) == {}  # nobody else yet
    assert prefill(b, {"r0": 50, "r1": 7}) == {"r0": 100}
    assert prefill(c, {"r1": 0}) == {"r0": 150, "r1": 7}  # its own never counted
    assert prefill(a, {"r0": 10}) == {"r0": 50, "r1": 7}
    assert prefill(b, {"r0": 50, "r1": 7}) == {"r0": 10}  # a's latest, not its first
    b.leave()
    assert prefill(a, {"r0": 10}) == {}  # c queued nothing, b left
    c.exchange(Load({}, {"r0": 2, "r1": 0}))
    b.exchange(Load({"r1": 5}, {"r0": 1, "r1": 1}))
    assert a.exchange(Load()) == Load({"r1": 5}, {"r0": 3, "r1": 1})


def test_a_replica_silent_past_the_stale_limit_counts_for_nothing_and_is_dropped(
    redis_server: RedisServer,
) -> None:
    a, b = shares(redis_server, 2)
    client = a.link.client
    old = orjson.dumps({"at": time.time() - 2 * STALE_S, "prefill": {"r0": 500}, "requests": {"r0": 4}})
    client.hset(a.key, "stalled", old)
    dead = orjson.dumps(
        {"at": time.time() - 2 * DROP_AFTER * STALE_S, "prefill": {"r0": 900}, "requests": {}}
    )
    client.hset(a.key, "dead", dead)
    b.exchange(Load({"r1": 3}))
    assert a.exchange(Load()) == Load({"r1": 3}, {})
    assert set(client.hkeys(a.key)) == {b"stalled", b"replica-0", b"replica-1"}  # the dead dropped


def test_with_redis_down_a_replica_routes_on_its_own_load(redis_server: RedisServer) -> None:
    a, b = shares(redis_server, 2)
    b.exchange(Load({"r0": 100}, {"r0": 3}))
    redis_server.stop()
    assert a.exchange(Load({"r0": 1})) == Load()
    assert LocalShare().exchange(Load({"r0": 1})) == Load()


def test_routing_and_admission_weigh_every_replicas_queue() -> None:
    """A new session's first turn goes to the rank the other replicas queued less on, and
    admission's read of a rank's queue is the fleet's."""
    router = Router(make_pool(2), make_policy("prefix_affinity"))
    router.share_load(Load({"r0": 200_000}))
    assert router.queued("r0") == 200_000 and router.queued("r1") == 0
    first = pick(router, make_ctx("a", chain("a", 10)))  # "a" favours r0 when queues tie
    assert first.name == "r1"
    assert router.queued("r1") == router.queued_prefill["r1"] > 0  # its own charge, live
    router.share_load(Load({"r1": 400_000}))
    assert pick(router, make_ctx("c", chain("c", 10))).name == "r0"  # "c" favours r1


def test_the_load_bound_counts_every_replicas_requests_in_flight() -> None:
    """A known session can leave its rank once the requests every replica has in flight there put it
    over CHWBL's bound, not this replica's alone (it then goes where it scores better: here the
    other replicas' prefill queued on its rank outweighs the 160 tokens it holds there); and an
    idle rank's tie goes to the less loaded."""
    pool = make_pool(2)
    router = Router(pool, make_policy("prefix_affinity"))
    history = chain("s", 10)
    home = pick(router, make_ctx("s", history)).name
    other = next(r.name for r in pool if r.name != home)
    history += chain("t2", 2, history[-1])
    router.share_load(Load({home: 1_000}))  # queued there, but within the bound: it stays
    assert pick(router, make_ctx("s", history)).name == home
    router.share_load(Load({home: 1_000}, {home: 6}))  # this replica has none in flight anywhere
    moved = pick(router, make_ctx("s", history + chain("t3", 2, history[-1])))
    assert moved.name == other
    assert router.own_load() == Load(
        {home: router.queued_prefill[home], other: router.queued_prefill[other]}, {home: 0, other: 0}
    )


def test_a_replica_sees_the_prefill_another_replica_queued(
    rank_servers: RankServers, redis_server: RedisServer
) -> None:
    """Two replicas on one Redis: while a request sent through one is held before its answer, the
    other's router and admission count its prefill and the request in flight on that rank, and stop
    once it is answered."""
    hold = threading.Event()
    (rank,) = rank_servers.stub(1, hold=hold)
    apps = [gateway_app([rank], redis_url=redis_server.url, health_interval=0.5) for _ in range(2)]
    servers = [ServerThread(app).start() for app in apps]
    try:
        routers = [app.state.gateway.router for app in apps]
        body = {"model": rank.name, "messages": [{"role": "user", "content": "hi " * 400}], "max_tokens": 4}
        sent = threading.Thread(
            target=httpx.post, args=(servers[0].url + "/v1/chat/completions",), kwargs={"json": body}
        )
        sent.start()
        wait_until(
            lambda: routers[0].queued_prefill[rank.name] > 0, "never saw the request queued on its replica"
        )
        queued = routers[0].queued_prefill[rank.name]
        wait_until(lambda: routers[1].queued(rank.name) == queued, "never saw the other replica's read of it")
        seen = routers[1].fleet.get(rank.name)
        assert seen is not None and (seen.in_flight, seen.others_in_flight, seen.load) == (0, 1, 1)
        hold.set()
        sent.join(10)
        wait_until(
            lambda: routers[1].queued(rank.name) == 0, "never saw the other replica's read of it answered"
        )
    finally:
        hold.set()
        for server in servers:
            server.stop()


def test_replicas_exchange_sooner_while_any_rank_has_load() -> None:
    idle = share_interval(Load(), Load({"r0": 0}, {"r0": 0}))
    assert idle == SHARE_INTERVAL_S
    assert share_interval(Load({"r0": 500}), Load()) == BUSY_INTERVAL_S  # its own prefill queued
    assert share_interval(Load(), Load({}, {"r1": 1})) == BUSY_INTERVAL_S  # another's request in flight
    assert BUSY_INTERVAL_S < SHARE_INTERVAL_S
