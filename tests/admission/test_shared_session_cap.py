"""``max_sessions_per_rank`` in the shared claims (``proxy/state/redis/claims.py``): the reserve
script counts each rank's claimed and reserved sessions and grants no place past the cap, in the
same atomic step as the tokens, whichever replica asks and however many ask at once."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from proxy.state.claims import Ask, LocalClaims
from proxy.state.redis.claims import RedisClaims
from proxy.state.redis.link import RedisLink, fail_fast_client
from tests.admission.test_release import Clock
from tests.helpers.redis_server import RedisServer

CAP = 3


def ask(
    key: str,
    ranks: tuple[str, ...] = ("r0",),
    cap: int | None = CAP,
    budgets: dict[str, int | None] | None = None,
) -> Ask:
    """An ``Ask`` for 100 tokens on ``ranks`` (no budget on them unless ``budgets`` gives one)."""
    return Ask(key, budgets or dict.fromkeys(ranks), 100, None, 0, 60.0, 5.0, cap)


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def links(redis_server: RedisServer) -> Iterator[list[RedisLink]]:
    made = [RedisLink(fail_fast_client(redis_server.url, 0.5), retry_interval=0.1) for _ in range(8)]
    yield made
    for link in made:
        link.flush()
        link.close()


def test_replicas_reserving_at_once_get_the_cap_of_places_between_them(links: list[RedisLink]) -> None:
    """Eight replicas (one link each, one thread each) ask for 5 places each on one rank at once."""
    claims = [RedisClaims(link) for link in links]
    granted: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(len(claims))

    def run(i: int) -> None:
        start.wait(10)
        for n in range(5):
            key = f"s{i}-{n}"
            if claims[i].reserve(ask(key)):
                with lock:
                    granted.append(key)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(claims))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(granted) == CAP, granted
    assert claims[0].sessions() == {"r0": CAP}
    assert claims[0].totals() == {"r0": CAP * 100}


def test_a_place_is_freed_by_release_by_expiry_and_by_idling_out(
    links: list[RedisLink], clock: Clock
) -> None:
    claims = RedisClaims(links[0], clock=clock)
    other = RedisClaims(links[1], clock=clock)
    for key in ("a", "b", "c"):
        assert claims.reserve(ask(key)) == {"r0"}
    claims.claim("a", "r0", 100, None, 0)
    claims.claim("b", "r0", 120, None, 0)
    links[0].flush()
    assert claims.sessions() == {"r0": 3}  # two claims and a reservation
    assert other.reserve(ask("d")) == frozenset()
    claims.release("a")
    links[0].flush()
    assert other.reserve(ask("d")) == {"r0"}
    assert other.reserve(ask("e")) == frozenset()
    clock.now += 6  # past the reservations' 5 s: "c" and "d" lapse
    assert other.reserve(ask("e")) == {"r0"}
    assert claims.sessions() == {"r0": 2}  # "b" claimed, "e" reserved
    clock.now += 61  # past the idle TTL: "b" idles out and so does "e"'s reservation
    assert other.reserve(ask("f")) == {"r0"}
    assert claims.sessions() == {"r0": 1}


def test_a_reservation_takes_a_place_on_each_rank_asked_and_its_claim_keeps_one(
    links: list[RedisLink],
) -> None:
    claims = RedisClaims(links[0])
    assert claims.reserve(ask("a", ("r0", "r1"), cap=1)) == {"r0", "r1"}
    assert claims.reserve(ask("b", ("r0", "r1"), cap=1)) == frozenset()
    claims.claim("a", "r1", 100, None, 0)
    links[0].flush()
    assert claims.sessions() == {"r1": 1}
    assert claims.reserve(ask("b", ("r0", "r1"), cap=1)) == {"r0"}
    # a session's next claim replaces its last: it never counts twice, on one rank or two
    claims.claim("a", "r1", 300, None, 0)
    claims.claim("b", "r0", 100, None, 0)
    links[0].flush()
    assert claims.sessions() == {"r0": 1, "r1": 1}


def test_the_cap_holds_within_the_budget_and_only_binds_when_set(links: list[RedisLink]) -> None:
    claims = RedisClaims(links[0])
    budgets: dict[str, int | None] = {"r0": 50}
    assert claims.reserve(ask("a", cap=2, budgets=budgets)) == {"r0"}  # empty rank
    assert claims.reserve(ask("b", cap=2, budgets=budgets)) == frozenset()  # past the budget
    assert claims.reserve(ask("b", cap=2)) == {"r0"}  # no budget
    assert claims.reserve(ask("c", cap=2)) == frozenset()  # the cap
    assert claims.reserve(ask("c", cap=None)) == {"r0"}  # no cap
    assert claims.sessions() == {"r0": 3}


def test_local_claims_grant_what_the_replicas_own_count_allowed() -> None:
    local = LocalClaims()
    for key in ("a", "b", "c", "d"):
        assert local.reserve(ask(key, ("r0", "r1"), cap=1)) == {"r0", "r1"}
    assert local.sessions() == {}
