"""The writes a replica queues for Redis, and how late they land, are visible: the link's backlog,
and its two gauges on ``/metrics`` (exported only with Redis); so are the session saves Redis dropped
for a later version."""

from __future__ import annotations

import threading
import time

import httpx
import redis

from proxy.state.redis.backend import RedisState
from proxy.state.redis.link import RedisLink, fail_fast_client
from proxy.state.sessions import Session
from tests.helpers.redis_server import RedisServer
from tests.helpers.wait import wait_until
from tests.reliability.conftest import chat, post_turns


def gauge(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def test_the_backlog_counts_queued_writes_and_the_wait_of_the_latest(redis_server: RedisServer) -> None:
    link = RedisLink(fail_fast_client(redis_server.url, 1.0))
    try:
        release = threading.Event()
        link.submit(lambda: release.wait(10))
        link.submit(lambda: None)
        link.submit(lambda: None)
        wait_until(lambda: link.backlog()[0] == 2, "the held write is running, two wait")
        time.sleep(0.05)
        release.set()
        link.flush()
        queued, waited = link.backlog()
        assert queued == 0
        assert waited >= 0.05  # the last write waited behind the held one
    finally:
        link.close()


def test_metrics_show_the_write_backlog_with_redis(rank_servers, gateway, redis_server):  # type: ignore[no-untyped-def]
    proxy = gateway(rank_servers.sim(2), policy="prefix_affinity", redis_url=redis_server.url)
    post_turns(proxy.url, "backlog test " * 60, "backlog-session")
    wait_until(lambda: gauge(proxy.url, "prefixgate_redis_writes_queued") == 0.0, "the writes landed")
    assert gauge(proxy.url, "prefixgate_redis_write_wait_seconds") > 0.0  # set by a write that ran
    client = redis.Redis(port=redis_server.port, socket_timeout=2)
    try:
        assert client.zcard("prefixgate:sessions:seen") == 1  # the session's record landed behind
    finally:
        client.close()


def test_a_save_dropped_for_a_later_version_is_counted_by_the_replica_that_made_it(
    redis_server: RedisServer,
) -> None:
    mine, other = RedisState(redis_server.url, 1.0, 60.0), RedisState(redis_server.url, 1.0, 60.0)
    try:
        store, theirs = mine.sessions(), other.sessions()
        store.save(Session("k", created=1.0, last_seen=2.0, rank="r1", turns=1))
        mine.link.flush()
        later = theirs.get("k")
        assert later is not None
        later.turns, later.version = 2, 5  # the next turns, saved by the other replica meanwhile
        theirs.save(later)
        other.link.flush()
        stale = Session("k", created=1.0, last_seen=3.0, rank="r1", turns=1, version=1)
        store.save(stale)  # a settlement of turn 1 landing late: version 2, under the stored 6
        mine.link.flush()
        assert mine.dropped_saves() == 1 and other.dropped_saves() == 0
        kept = theirs.get("k")
        assert kept is not None and kept.turns == 2  # the later save stands
    finally:
        mine.close()
        other.close()


def test_metrics_show_dropped_saves_with_redis(rank_servers, gateway, redis_server):  # type: ignore[no-untyped-def]
    proxy = gateway(rank_servers.sim(1), policy="prefix_affinity", redis_url=redis_server.url)
    answer = httpx.post(proxy.url + "/v1/chat/completions", json=chat("dropped saves " * 60), timeout=15)
    assert answer.status_code == 200
    assert gauge(proxy.url, "prefixgate_session_saves_dropped") == 0.0  # exported, and none dropped


def test_a_redis_that_does_not_keep_up_opens_the_circuit_and_comes_back(redis_server: RedisServer) -> None:
    """Writes queued without bound would grow this replica's memory and the shared state's lag for
    as long as Redis stays slow; past ``max_backlog`` Redis counts as failing instead."""
    link = RedisLink(fail_fast_client(redis_server.url, 1.0), retry_interval=0.1, max_backlog=10)
    states: list[bool] = []
    link.on_state(states.append)
    try:
        release = threading.Event()
        ran: list[int] = []
        link.submit(lambda: release.wait(10))  # a write Redis is slow to answer
        wait_until(lambda: link.backlog()[0] == 0, "the slow write is running")
        for k in range(10):
            link.submit(lambda k=k: ran.append(k))  # type: ignore[misc]
        assert link.up, "ten writes wait: at the bound, not past it"
        link.submit(lambda: ran.append(10))
        assert not link.up and states == [False]
        release.set()
        link.flush()
        assert link.backlog()[0] == 0 and ran == [], "the queued writes were skipped, not run late"
        wait_until(lambda: link.up, "a probe found Redis answering")
        assert states == [False, True] and link.backlog_trips == 1
        link.submit(lambda: ran.append(11))
        link.flush()
        assert ran == [11]
        assert link.backlog_trips == 0, "the writes caught up: the next overflow starts the backoff over"
    finally:
        link.close()


def test_a_redis_that_falls_behind_again_before_catching_up_is_left_alone_longer(
    redis_server: RedisServer,
) -> None:
    """Each reconnection pushes every mirror back: a Redis that stays slow is not sent them every
    ``retry_interval``; the circuit stays open twice as long each time until the writes catch up."""
    link = RedisLink(fail_fast_client(redis_server.url, 1.0), retry_interval=0.05, max_backlog=3)
    release = threading.Event()
    try:
        link.submit(lambda: release.wait(10))
        wait_until(lambda: link.backlog()[0] == 0, "the slow write is running")
        for _ in range(4):
            link.submit(lambda: None)
        assert not link.up and link.backlog_trips == 1
        # Back up (a caller off any event loop probes itself) while the slow write still holds the
        # link's thread, so the writes have not caught up: the next overflow is the second in a row.
        wait_until(link.available, "Redis answers a probe")
        for _ in range(4):
            link.submit(lambda: None)
        assert not link.up and link.backlog_trips == 2
    finally:
        release.set()
        link.close()
