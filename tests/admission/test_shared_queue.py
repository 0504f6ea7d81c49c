"""Admission's wait order shared through Redis (``proxy/state/redis_queue.py``): the waiters of every
replica stand in one queue, so room that frees goes to the first of them, whichever replica it
waits on, not to whichever replica looks first.

Each replica here is an ``Admission`` with its own Redis link, claims and order, as a replica process
has; they share one event loop, which makes "who looks first" deterministic: a replica's own release
wakes its own waiters at once, another replica's waiters only once the room channel's word reaches
them from its listener's thread (or at their next poll). On the code before (one order per
replica) the later session wins in each test below."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from proxy.admission import Admission, AdmissionConfig
from proxy.admission.queue import LEASE_S
from proxy.context import Outcome, RequestContext
from proxy.ops.auth import ClientKey
from proxy.stages.usage import Usage
from proxy.state.claims import Ask, Reserved
from proxy.state.redis import RedisSessionStore
from proxy.state.redis_claims import RedisClaims
from proxy.state.redis_queue import RedisWaitOrder, queue_keys
from proxy.state.sessions import SessionTable
from proxy.state.wait_order import Entry, Place
from routing.ranks import Fleet, Rank
from routing.redis_link import RedisLink, fail_fast_client
from tests.admission.test_release import ctx_for
from tests.helpers.redis_server import RedisServer
from tests.helpers.wait import wait_until, wait_until_async

POOL = 2000  # budget 1,600 tokens at the default 0.8: two 700-token sessions fit, a third does not
TOKENS = 700
TTL = 300.0
#: The rotation bound: far longer than any test waits, so that no seat rotates on its own.
BOUND = 120.0
#: How long a test waits for a condition before failing (never an assert on a duration).
PATIENCE = 30.0


class Replica:
    """One replica's admission over the shared Redis: its own link, session store, claims and order."""

    def __init__(self, url: str) -> None:
        self.link = RedisLink(fail_fast_client(url, 0.25), retry_interval=0.1)
        self.order_states: list[bool] = []
        self.order = RedisWaitOrder(self.link, on_state=self.order_states.append)
        fleet = Fleet([Rank("r0", "http://r0", pool_tokens=POOL)])
        config = AdmissionConfig(idle_ttl=TTL, wait=BOUND, block_size=16)
        table = SessionTable(RedisSessionStore(url, link=self.link), TTL)
        self.admission = Admission(table, fleet, config, None, None, RedisClaims(self.link), self.order)

    def arrive(self, key: str, priority: int = 0) -> asyncio.Task[RequestContext]:
        """A new session's first request, admitted (or waiting) in the background."""
        ctx = ctx_for(key, TOKENS)
        if priority:
            ctx.client = ClientKey(f"p{priority}", b"", priority=priority)
            ctx.priority = priority  # the identify stage's: the key's own class, no header

        async def admit() -> RequestContext:
            ctx.admitted = await self.admission.admit(ctx)
            return ctx

        return asyncio.ensure_future(admit())

    async def hold(self, key: str, priority: int = 0) -> None:
        """Admit, place on r0 and answer a session: it holds its room until released."""
        ctx = await asyncio.wait_for(self.arrive(key, priority), PATIENCE)
        self.place_and_answer(ctx)

    def place_and_answer(self, ctx: RequestContext) -> None:
        assert ctx.admitted is not None and ctx.admitted.allowed == frozenset({"r0"})
        rank = self.admission.fleet.get("r0")
        assert rank is not None
        self.admission.placed(ctx, rank)
        self.admission.finished(Outcome(ctx, "r0", 200, Usage(TOKENS, 16, 0)))
        self.link.flush()

    def release(self, key: str) -> None:
        self.admission.release(key)
        self.link.flush()

    def close(self) -> None:
        self.link.flush()
        self.link.close()


@pytest.fixture
def replicas(redis_server: RedisServer) -> Iterator[tuple[Replica, Replica]]:
    a, b = Replica(redis_server.url), Replica(redis_server.url)
    yield a, b
    a.close()
    b.close()


async def until(condition: Callable[[], bool], what: str) -> None:
    """Yield to the event loop until ``condition()`` holds (``PATIENCE`` at most)."""
    await wait_until_async(condition, what, PATIENCE)


def waiting(replica: Replica, count: int) -> Callable[[], bool]:
    return lambda: len(replica.admission.queue) == count


def shared_places(url: str) -> int:
    """Waiters standing in the shared order (every replica's)."""
    client = redis.Redis.from_url(url)
    try:
        return int(client.zcard(queue_keys(client)[0]))
    finally:
        client.close()


async def test_an_earlier_waiter_on_one_replica_gets_the_room_before_a_later_arrival_on_another(
    replicas: tuple[Replica, Replica], redis_server: RedisServer
) -> None:
    a, b = replicas
    await b.hold("held-0")
    await b.hold("held-1")  # r0's budget is full
    early = a.arrive("early")
    await until(waiting(a, 1), "the early session never queued on replica A")
    b.release("held-0")  # room for one: B's own waiters would look at once, A's at its next poll
    late = b.arrive("late")  # admitted at once on the code before: B's own queue was empty
    ctx = await asyncio.wait_for(early, PATIENCE)
    assert not late.done(), "the later session on replica B took the room the earlier one waited for"
    a.place_and_answer(ctx)
    assert shared_places(redis_server.url) == 1  # the late session's place, nobody else's
    b.release("held-1")
    b.place_and_answer(await asyncio.wait_for(late, PATIENCE))  # its turn now
    assert shared_places(redis_server.url) == 0


async def test_a_higher_priority_waiter_on_another_replica_goes_first(
    replicas: tuple[Replica, Replica],
) -> None:
    a, b = replicas
    await a.hold("held-0", priority=5)  # of the high waiter's class: it may not park them at once
    await a.hold("held-1", priority=5)
    low = a.arrive("low", priority=-1)
    await until(waiting(a, 1), "the low-priority session never queued")
    high = b.arrive("high", priority=5)
    await until(waiting(b, 1), "the high-priority session never queued")
    a.release("held-0")  # wakes A's low-priority waiter at once; B's looks at its next poll
    ctx = await asyncio.wait_for(high, PATIENCE)
    assert not low.done(), "the low-priority waiter took the room before the high-priority one"
    b.place_and_answer(ctx)
    a.release("held-1")
    a.place_and_answer(await asyncio.wait_for(low, PATIENCE))


async def test_fair_share_tags_compare_across_replicas(replicas: tuple[Replica, Replica]) -> None:
    """Client ``busy`` queues two sessions on replica A, then ``quiet`` one on replica B: ``quiet``'s
    tag equals ``busy``'s first, not its second, as it would in one replica's queue."""
    a, b = replicas
    first = a.order.enter("busy", 0, 1.0, LEASE_S)
    second = a.order.enter("busy", 0, 1.0, LEASE_S)
    quiet = b.order.enter("quiet", 0, 1.0, LEASE_S)
    assert first is not None and second is not None and quiet is not None
    assert first.order < quiet.order < second.order
    for place in (first, second, quiet):
        a.order.leave(place, served=False)


GHOST = """
import asyncio, sys
from proxy.admission.queue import WaitQueue
from proxy.state.redis_queue import RedisWaitOrder
from routing.redis_link import RedisLink, fail_fast_client

order = RedisWaitOrder(RedisLink(fail_fast_client(sys.argv[1], 0.5)))
queue = WaitQueue(0.25, order)
# a waiter that never finds room: it stands first in the shared order and renews its lease
asyncio.run(queue.wait(lambda: None, lambda depth: print("waiting", flush=True)))
"""


async def test_a_dead_replicas_waiters_lapse_and_block_nobody(
    replicas: tuple[Replica, Replica], redis_server: RedisServer
) -> None:
    _, b = replicas
    ghost = subprocess.Popen([sys.executable, "-c", GHOST, redis_server.url], stdout=subprocess.PIPE)
    try:
        assert ghost.stdout is not None and ghost.stdout.readline() == b"waiting\n"
        client = redis.Redis.from_url(redis_server.url)
        leases = queue_keys(client)[2]
        (place, first_expiry), *_ = client.zrange(leases, 0, -1, withscores=True)
        fresh = b.arrive("fresh")  # r0 has room, but the ghost's waiter stands before it
        await until(waiting(b, 1), "the fresh session never queued behind the live waiter")
        # past the ghost's first lease: only its renewals keep it first
        await until(lambda: time.time() > first_expiry + 0.5, "the clock stood still")
        assert client.zscore(leases, place) is not None
        assert not fresh.done(), "a live waiter on another replica was overtaken"
        ghost.kill()  # SIGKILL: it never leaves the order; its lease must lapse
        ghost.wait(10)
        b.place_and_answer(await asyncio.wait_for(fresh, PATIENCE))
        assert shared_places(redis_server.url) == 0
        client.close()
    finally:
        ghost.kill()
        ghost.wait(10)


async def test_redis_down_each_replica_queues_in_its_own_order(
    replicas: tuple[Replica, Replica], redis_server: RedisServer
) -> None:
    a, _ = replicas
    redis_server.stop()
    await a.hold("held-0")  # on its own count: the claims fall back too
    await a.hold("held-1")
    early = a.arrive("early")
    await until(waiting(a, 1), "the early session never queued")
    late = a.arrive("late")
    await until(waiting(a, 2), "the late session never queued")
    assert a.order_states == [False]  # said once; the waiters stand in this replica's order
    a.release("held-0")
    a.place_and_answer(await asyncio.wait_for(early, PATIENCE))
    assert not late.done()
    a.release("held-1")
    a.place_and_answer(await asyncio.wait_for(late, PATIENCE))
    redis_server.start()
    await until(lambda: a.link.available(), "the link never closed again")
    back = a.order.enter(None, 0, 1.0, LEASE_S)
    assert back is not None and a.order_states == [False, True]
    a.order.leave(back, served=False)


# -- the order's edges: a place taken in the same step as the failed reservation, restored places
# keep their turn in a restarted Redis, room freed on one replica wakes another's waiters


BUDGET = int(POOL * 0.8)  # the replicas' one rank's


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

    def reserve_or_enter(self, ask: Ask, entry: Entry | None) -> Reserved:
        reserved = self.claims.reserve_or_enter(ask, entry)
        if not reserved.granted:
            self._denied()
        return reserved

    def __getattr__(self, name: str) -> Any:
        return getattr(self.claims, name)


def newcomer(key: str) -> Ask:
    """What a new session's first reservation asks (not waiting: granted only while nobody waits)."""
    return Ask(key, {"r0": BUDGET}, TOKENS, None, 0, TTL, 30.0, queued=True)


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
