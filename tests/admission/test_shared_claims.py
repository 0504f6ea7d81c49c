"""Admission's claims on room shared through Redis (``proxy/state/redis/claims.py``): replicas that
count the same sessions but admit at the same moment take each rank's room once, not once each."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest

from proxy.admission import Admission, AdmissionConfig
from proxy.apis.base import Usage
from proxy.config import DEFAULT_TARGET_FRACTION
from proxy.context import Outcome, RequestContext
from proxy.state.claims import LocalClaims
from proxy.state.redis.claims import RedisClaims
from proxy.state.redis.link import RedisLink, fail_fast_client
from proxy.state.redis.sessions import RedisSessionStore
from proxy.state.sessions import SessionTable
from routing.ranks import Fleet, Rank
from tests.admission.test_release import ctx_for
from tests.helpers.redis_server import RedisServer

POOL = 2000  # at the default budget share two 700-token sessions fit, a third does not
BUDGET = int(POOL * DEFAULT_TARGET_FRACTION)
TOKENS = 700
TTL = 300.0
CAP = 2  # max_sessions_per_rank, where a test sets it
#: How long a session is let wait for a seat before the test takes it for one with no room.
WAITS_S = 0.3


class Replica:
    """One replica's admission over the shared Redis: its own link, session store and claims."""

    def __init__(
        self,
        url: str,
        ranks: int = 1,
        shared: bool = True,
        pool: int = POOL,
        max_sessions_per_rank: int | None = None,
    ) -> None:
        self.link = RedisLink(fail_fast_client(url, 0.25), retry_interval=0.1)
        self.claims = RedisClaims(self.link) if shared else None
        store = RedisSessionStore(url, link=self.link)
        fleet = Fleet(Rank(f"r{i}", f"http://r{i}", pool_tokens=pool) for i in range(ranks))
        config = AdmissionConfig(
            idle_ttl=TTL,
            wait=3600.0,  # no seat rotates within a test: these are about room and claims
            block_size=16,
            max_sessions_per_rank=max_sessions_per_rank,
        )
        self.admission = Admission(
            SessionTable(store, TTL), fleet, config, None, None, self.claims or LocalClaims()
        )

    async def admit(self, key: str) -> RequestContext | None:
        """Admit a new session's first request (None: no room, it would wait for a seat)."""
        ctx = ctx_for(key, TOKENS)
        try:
            ctx.admitted = await asyncio.wait_for(self.admission.admit(ctx), WAITS_S)
        except TimeoutError:
            return None
        return ctx

    def place_and_answer(self, ctx: RequestContext) -> str:
        """The router's pick (the first allowed rank), then the rank's answer."""
        admitted = ctx.admitted
        assert admitted is not None and admitted.allowed
        rank = self.admission.fleet.get(sorted(admitted.allowed)[0])
        assert rank is not None
        self.admission.placed(ctx, rank)
        self.admission.finished(Outcome(ctx, rank.name, 200, Usage(TOKENS, 16, 0)))
        return rank.name

    def close(self) -> None:
        self.link.flush()
        self.link.close()


@pytest.fixture
def replicas(redis_server: RedisServer) -> Iterator[list[Replica]]:
    made = [Replica(redis_server.url) for _ in range(3)]
    yield made
    for replica in made:
        replica.close()


async def admit_interleaved(
    replicas: list[Replica], per_replica: int, tag: str = "s"
) -> dict[str, list[str]]:
    """Every replica admits ``per_replica`` new sessions before any of them is placed (the moment
    they all check room at once); then each is placed and answered. Sessions per rank."""
    admitted = []
    for n in range(per_replica):
        for i, replica in enumerate(replicas):
            ctx = await replica.admit(f"{tag}{i}-{n}")
            if ctx is not None:
                admitted.append((replica, ctx))
    placed: dict[str, list[str]] = {}
    for replica, ctx in admitted:
        assert ctx.session_key is not None
        placed.setdefault(replica.place_and_answer(ctx), []).append(ctx.session_key)
    return placed


def working_set(replica: Replica, rank: str) -> int:
    return replica.admission.count()[rank].working_set_tokens


async def test_replicas_admitting_at_once_fill_a_rank_to_its_budget_once(replicas: list[Replica]) -> None:
    placed = await admit_interleaved(replicas, 2)
    assert len(placed["r0"]) == 2, f"two sessions fit r0's budget, the replicas placed {placed}"
    for replica in replicas:  # each replica counts the same sessions, within the budget
        assert working_set(replica, "r0") <= BUDGET
    for replica in replicas:
        replica.link.flush()
    claims = replicas[0].claims
    assert claims is not None
    # the two sessions' contexts after their answers, whichever replica wrote them
    assert claims.totals() == {"r0": 2 * (TOKENS + 16)} == {"r0": working_set(replicas[0], "r0")}


async def admit_on_own_counts(url: str, per_replica: int, **replica: Any) -> dict[str, list[str]]:
    """``admit_interleaved`` on three replicas without shared claims (``replica``: ``Replica``'s
    other arguments)."""
    local = [Replica(url, shared=False, **replica) for _ in range(3)]
    try:
        return await admit_interleaved(local, per_replica)
    finally:
        for made in local:
            made.close()


async def test_without_shared_claims_each_replica_takes_the_same_room(redis_server: RedisServer) -> None:
    """What the shared claims fix: each replica's own reservations only hold back its own waiters."""
    placed = await admit_on_own_counts(redis_server.url, 2)
    assert len(placed["r0"]) == 6


async def fill_capped_ranks(replicas: list[Replica], rounds: int) -> dict[str, list[str]]:
    """``admit_interleaved`` one session per replica, ``rounds`` times; after each round every
    rank's shared session count is checked against the cap. Sessions per rank."""
    placed: dict[str, list[str]] = {}
    for n in range(rounds):
        for rank, keys in (await admit_interleaved(replicas, 1, f"round{n}")).items():
            placed.setdefault(rank, []).extend(keys)
        for replica in replicas:
            replica.link.flush()
        claims = replicas[0].claims
        if claims is not None:
            counted = claims.sessions()
            assert all(held <= CAP for held in counted.values()), (
                f"round {n}: {counted} past the cap of {CAP}"
            )
    return placed


async def test_replicas_admitting_at_once_never_put_more_than_the_session_cap_on_a_rank(
    redis_server: RedisServer,
) -> None:
    """Room for every session (a large pool), but ``max_sessions_per_rank`` of 2: three replicas
    checking room at the same moment take each rank's two places once between them."""
    capped = [Replica(redis_server.url, 2, pool=100 * POOL, max_sessions_per_rank=CAP) for _ in range(3)]
    try:
        placed = await fill_capped_ranks(capped, 3)
        assert {rank: len(keys) for rank, keys in placed.items()} == {"r0": CAP, "r1": CAP}, placed
        claims = capped[0].claims
        assert claims is not None
        assert claims.sessions() == {"r0": CAP, "r1": CAP}
        for replica in capped:  # and each replica's own count agrees
            assert [replica.admission.count()[r].sessions for r in ("r0", "r1")] == [CAP, CAP]
        assert await capped[2].admit("one-too-many") is None
        capped[0].admission.release(placed["r1"][0])
        capped[0].link.flush()
        ctx = await capped[2].admit("one-too-many")  # the freed place, seen by another replica
        assert ctx is not None and capped[2].place_and_answer(ctx) == "r1"
    finally:
        for replica in capped:
            replica.close()


async def test_without_the_shared_session_cap_each_replica_fills_a_rank_to_it(
    redis_server: RedisServer,
) -> None:
    """What the cap in the shared claims fixes: each replica's own count allows the same places."""
    placed = await admit_on_own_counts(
        redis_server.url, 1, ranks=2, pool=100 * POOL, max_sessions_per_rank=CAP
    )
    assert len(placed["r0"]) == 3


async def test_a_released_session_frees_its_room_for_every_replica(replicas: list[Replica]) -> None:
    first, third = replicas[0], replicas[2]
    placed = await admit_interleaved(replicas, 1)
    assert len(placed["r0"]) == 2
    refused = await third.admit("late")
    assert refused is None
    first.admission.release(placed["r0"][0])
    first.link.flush()
    ctx = await third.admit("late")
    assert ctx is not None and third.place_and_answer(ctx) == "r0"


async def test_redis_down_each_replica_admits_on_its_own_count_then_claims_are_pushed_back(
    redis_server: RedisServer,
) -> None:
    replica = Replica(redis_server.url)
    assert replica.claims is not None
    states: list[bool] = []
    replica.claims._on_state = states.append
    try:
        ctx = await replica.admit("before")
        assert ctx is not None
        replica.place_and_answer(ctx)
        replica.link.flush()
        redis_server.stop()
        ctx = await replica.admit("during")  # Redis is down: the replica's own count decides
        assert ctx is not None and ctx.admitted is not None and ctx.admitted.allowed == {"r0"}
        replica.place_and_answer(ctx)
        assert states == [False]
        assert await replica.admit("third") is None, "its own count still holds the budget"
        redis_server.start()  # empty: the claims are pushed back when the link sees it again
        deadline = time.monotonic() + 10
        while not replica.link.up and time.monotonic() < deadline:
            replica.link.available()
            time.sleep(0.05)
        assert states == [False, True]
        assert replica.claims.totals() == {"r0": 2 * (TOKENS + 16)}
    finally:
        replica.close()
