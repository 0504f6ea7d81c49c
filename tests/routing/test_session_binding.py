"""Session bindings shared through Redis: the first replica to bind a new session wins, atomically,
and a replica that decided otherwise at the same moment adopts the winner's rank."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import ClassVar

from proxy.stages.route import Router
from proxy.state.redis.index import RedisPrefixIndex
from routing.index.memory import MemoryPrefixIndex
from routing.policies import Needs, PolicyOptions, RouteRequest
from routing.ranks import Rank
from tests.routing.conftest import RedisServer, chain, make_ctx, make_pool


class Racing:
    """Prefers ``first``, and waits at ``barrier`` after the router's lookup so that every replica
    has looked the session up (and found it unbound) before any of them binds it."""

    name: ClassVar[str] = "racing"
    needs: ClassVar[Needs] = Needs(blocks=True, prefix_index=True)

    def __init__(self, first: str, barrier: threading.Barrier) -> None:
        self.first = first
        self.barrier = barrier
        self.saw: list[str | None] = []

    @classmethod
    def from_options(cls, options: PolicyOptions) -> Racing:
        raise NotImplementedError

    def order(self, request: RouteRequest, candidates: Sequence[Rank]) -> list[Rank]:
        self.saw.append(request.session_rank)
        self.barrier.wait(timeout=10)
        return sorted(candidates, key=lambda r: r.name != self.first)


def race(routers: list[Router], session: str) -> list[str]:
    """Every router plans the same new session's first request at once; the ranks they send it to."""
    placed: dict[int, str] = {}
    hashes = chain("race", 6)

    def plan(i: int) -> None:
        placed[i] = routers[i].plan(make_ctx(session, hashes)).ranks[0].name

    threads = [threading.Thread(target=plan, args=(i,)) for i in range(len(routers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    return [placed[i] for i in range(len(routers))]


def test_replicas_racing_on_a_new_session_agree_on_the_first_binding(redis_server: RedisServer) -> None:
    barrier = threading.Barrier(3)
    policies = [Racing(first, barrier) for first in ("r0", "r1", "r2")]
    indexes = [RedisPrefixIndex(redis_server.url, model="m", block_size=16) for _ in policies]
    routers = [Router(make_pool(3), policy, index) for policy, index in zip(policies, indexes, strict=True)]
    try:
        for round_ in range(5):
            session = f"race-{round_}"
            placed = race(routers, session)
            assert all(p.saw[-1] is None for p in policies), "every replica found the session unbound"
            assert len(set(placed)) == 1, f"replicas placed one new session on {placed}"
            for index in indexes:  # and every replica's next lookup says the same rank
                index.local.forget_session(session)
                assert index.lookup([], session).session_rank == placed[0]
    finally:
        for index in indexes:
            index.close()


def test_a_session_moved_by_one_replica_is_not_moved_back_by_a_stale_one(redis_server: RedisServer) -> None:
    first, second = (RedisPrefixIndex(redis_server.url, model="m", block_size=16) for _ in range(2))
    try:
        assert first.bind_session("s", "r0", None) == "r0"
        assert second.bind_session("s", "r1", None) == "r0", "bound already: the loser adopts r0"
        assert first.bind_session("s", "r2", "r0") == "r2", "a move from the rank it saw is written"
        assert second.bind_session("s", "r1", "r0") == "r2", "a move from a stale view adopts the newer"
        assert second.bind_session("s", "r2", "r2") == "r2"
    finally:
        first.close()
        second.close()


def test_memory_index_binds_as_asked() -> None:
    index = MemoryPrefixIndex()
    assert index.bind_session("s", "r0", None) == "r0"
    assert index.bind_session("s", "r1", "r0") == "r1"
    assert index.lookup([], "s").session_rank == "r1"
