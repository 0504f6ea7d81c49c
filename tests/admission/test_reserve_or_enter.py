"""The shared wait order's edges (``proxy/state/redis_claims.py``, ``proxy/state/redis_queue.py``):
a session that finds no room takes its place in the same step (nobody arriving later takes the
room between the two), restored places keep their turn in a restarted Redis, and room freed on one
replica wakes the waiters of another without their poll.

Replicas as in ``test_shared_queue.py``: each an ``Admission`` with its own Redis link, claims and
order, all on one event loop, over a real redis-server the test starts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from proxy.context import Outcome
from proxy.state.claims import Ask, Reserved
from proxy.state.redis_claims import RedisClaims
from proxy.state.redis_queue import RedisWaitOrder, queue_keys
from proxy.state.wait_order import Entry, Place
from routing.redis_link import RedisLink, fail_fast_client
from tests.admission.test_shared_queue import PATIENCE, TOKENS, TTL, Replica, shared_places, until, waiting
from tests.helpers.redis_server import RedisServer
from tests.helpers.wait import wait_until

BUDGET = 1600  # the replicas' one rank: a pool of 2,000 at the default 0.8


@pytest.fixture
def replicas(redis_server: RedisServer) -> Iterator[tuple[Replica, Replica]]:
    a, b = Replica(redis_server.url), Replica(redis_server.url)
    yield a, b
    a.close()
    b.close()


class DeniedHook:
    """A replica's claims that run ``hook()`` right after the first reservation granting nothing:
    the moment between a session's failed reservation and its place in the wait order (two round
    trips on the code before, one step now)."""

    def __init__(self, claims: RedisClaims, hook: Callable[[], None]) -> None:
        self.claims = claims
        self.hook: Callable[[], None] | None = hook

    def _denied(self) -> None:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()

    def reserve(self, ask: Ask) -> frozenset[str]:
        granted = self.claims.reserve(ask)
        if not granted:
            self._denied()
        return granted

    def reserve_or_enter(self, ask: Ask, entry: Entry) -> Reserved:
        reserved = self.claims.reserve_or_enter(ask, entry)
        if not reserved.granted:
            self._denied()
        return reserved

    def __getattr__(self, name: str) -> Any:
        return getattr(self.claims, name)


def newcomer(key: str) -> Ask:
    """What a new session's first reservation asks (not waiting: granted only while nobody waits)."""
    return Ask(key, {"r0": BUDGET}, TOKENS, None, 0, False, TTL, 30.0, queued=True)


async def test_a_later_arrival_between_a_failed_reservation_and_its_wait_cannot_take_the_room(
    replicas: tuple[Replica, Replica], redis_server: RedisServer
) -> None:
    """Replica B holds one session and a reservation A's count cannot see (B's, not yet placed):
    A's ``early`` session finds room by its count, not in the shared claims. Right then, B's
    reservation fails (its request found no rank) and a ``late`` newcomer on B asks for room: on the
    code before, the order was still empty (``early`` entered it one round trip later) and ``late``
    took the room."""
    a, b = replicas
    await b.hold("held")
    pending = await asyncio.wait_for(b.arrive("pending"), PATIENCE)  # reserved on r0, not placed
    late: list[frozenset[str]] = []

    def between() -> None:
        b.admission.finished(Outcome(pending, None, 502))  # no rank answered: its room is free
        b.link.flush()
        late.append(b.admission.claims.reserve(newcomer("late")))

    a.admission.claims = DeniedHook(RedisClaims(a.link), between)
    early = a.arrive("early")
    await until(lambda: bool(late), "the early session's reservation was never denied")
    assert late == [frozenset()], "the later arrival on replica B took the room the earlier one found none of"
    a.place_and_answer(await asyncio.wait_for(early, PATIENCE))  # the freed room is the early one's
    assert shared_places(redis_server.url) == 0


def enter(order: RedisWaitOrder) -> Place:
    """A place in ``order``, once its link reaches Redis (after a restart it may first fail)."""
    return wait_until(lambda: order.enter(None, 0, 1.0, 30.0), "the order never reached Redis", PATIENCE)


def test_restored_places_keep_their_turn_ahead_of_new_arrivals_after_a_restart(
    redis_server: RedisServer,
) -> None:
    """Two waiters of replica A (the second's fair-share tag after the first's), then Redis restarts
    empty: A's next renewal restores their places, and a session arriving after that on replica B
    stands behind both. On the code before, the order's clocks restarted at zero and the newcomer
    went before the second waiter (and, by its random id, maybe the first)."""
    links = [RedisLink(fail_fast_client(redis_server.url, 0.25), retry_interval=0.1) for _ in range(2)]
    a, b = (RedisWaitOrder(link) for link in links)
    try:
        first, second = enter(a), enter(a)
        assert first.order < second.order
        redis_server.stop()
        redis_server.start()
        assert shared_places(redis_server.url) == 0  # every key lost

        def renewed() -> bool:
            a.renew([first, second], 30.0)
            return shared_places(redis_server.url) == 2

        wait_until(renewed, "replica A's renewal never restored its places", PATIENCE)
        late = enter(b)
        assert first.order < late.order and second.order < late.order, (first, second, late)
        client = redis.Redis.from_url(redis_server.url)
        try:
            standing = [m.decode() for m in client.zrange(queue_keys(client)[0], 0, -1)]
        finally:
            client.close()
        assert standing == [first.member, second.member, late.member]
    finally:
        for link in links:
            link.close()


async def test_room_freed_on_one_replica_wakes_a_waiter_on_another_without_its_poll(
    replicas: tuple[Replica, Replica], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A's waiter polls once an hour here: only the room channel can tell it B released room."""
    a, b = replicas
    monkeypatch.setattr(a.admission, "poll_interval", lambda: 3600.0)
    a.admission.queue.poll_interval = 3600.0
    await b.hold("held-0")
    await b.hold("held-1")
    early = a.arrive("early")
    await until(waiting(a, 1), "the early session never queued")
    b.release("held-0")
    a.place_and_answer(await asyncio.wait_for(early, PATIENCE))
