"""Waiters for room on replicas that share their claims through Redis
(``proxy/state/redis/claims.py``): each replica's waiters stand in its own queue, and room another
replica frees wakes them through the claims' room channel, not only at their next poll.

Each replica here is an ``Admission`` with its own Redis link and claims, as a replica process has;
they share one event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from proxy.admission import Admission, AdmissionConfig
from proxy.apis.base import Usage
from proxy.context import Outcome, RequestContext
from proxy.state.redis.claims import RedisClaims
from proxy.state.redis.link import RedisLink, fail_fast_client
from proxy.state.redis.sessions import RedisSessionStore
from proxy.state.sessions import SessionTable
from routing.ranks import Fleet, Rank
from tests.admission.test_release import ctx_for
from tests.helpers.redis_server import RedisServer
from tests.helpers.wait import wait_until_async

POOL = 2000  # budget 1,600 tokens at the default 0.8: two 700-token sessions fit, a third does not
TOKENS = 700
TTL = 300.0
#: The rotation bound: far longer than any test waits, so that no seat rotates on its own.
BOUND = 120.0
#: How long a test waits for a condition before failing (never an assert on a duration).
PATIENCE = 30.0


class Replica:
    """One replica's admission over the shared Redis: its own link, session store and claims."""

    def __init__(self, url: str) -> None:
        self.link = RedisLink(fail_fast_client(url, 0.25), retry_interval=0.1)
        self.claims_states: list[bool] = []
        claims = RedisClaims(self.link, on_state=self.claims_states.append)
        fleet = Fleet([Rank("r0", "http://r0", pool_tokens=POOL)])
        config = AdmissionConfig(idle_ttl=TTL, wait=BOUND, block_size=16)
        table = SessionTable(RedisSessionStore(url, link=self.link), TTL)
        self.admission = Admission(table, fleet, config, None, None, claims)

    def arrive(self, key: str) -> asyncio.Task[RequestContext]:
        """A new session's first request, admitted (or waiting) in the background."""
        ctx = ctx_for(key, TOKENS)

        async def admit() -> RequestContext:
            ctx.admitted = await self.admission.admit(ctx)
            return ctx

        return asyncio.ensure_future(admit())

    async def hold(self, key: str) -> None:
        """Admit, place on r0 and answer a session: it holds its room until released."""
        ctx = await asyncio.wait_for(self.arrive(key), PATIENCE)
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


async def test_redis_down_each_replica_queues_in_its_own_order(
    replicas: tuple[Replica, Replica], redis_server: RedisServer
) -> None:
    a, _ = replicas
    redis_server.stop()
    await a.hold("held-0")  # on its own count: the claims fall back
    await a.hold("held-1")
    early = a.arrive("early")
    await until(waiting(a, 1), "the early session never queued")
    late = a.arrive("late")
    await until(waiting(a, 2), "the late session never queued")
    assert a.claims_states == [False]  # said once; the replica admits on its own count
    a.release("held-0")
    a.place_and_answer(await asyncio.wait_for(early, PATIENCE))
    assert not late.done()
    a.release("held-1")
    a.place_and_answer(await asyncio.wait_for(late, PATIENCE))
    redis_server.start()
    await until(lambda: a.link.available() and a.claims_states == [False, True], "the claims never came back")
