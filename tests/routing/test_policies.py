"""The policy registry and the ranked order every policy returns (first = the choice, then retries)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import ClassVar

import pytest

from proxy.stages.route import Router
from routing.policies import (
    POLICIES,
    Needs,
    PolicyOptions,
    RouteRequest,
    make_policy,
    needs_of,
    policy_names,
    register,
    unregister,
)
from routing.ranks import Rank
from tests.routing.conftest import chain, make_ctx, make_pool, pick


class LastFirst:
    """A toy policy, defined and registered by this one file: the last candidate first."""

    name: ClassVar[str] = "last_first"
    needs: ClassVar[Needs] = Needs(blocks=True)
    built: ClassVar[int] = 0

    def __init__(self, options: PolicyOptions) -> None:
        LastFirst.built += 1
        self.options = options

    @classmethod
    def from_options(cls, options: PolicyOptions) -> LastFirst:
        return cls(options)

    def order(self, request: RouteRequest, candidates: Sequence[Rank]) -> list[Rank]:
        return list(reversed(candidates))


@pytest.fixture
def last_first() -> Iterator[type[LastFirst]]:
    register(LastFirst)
    yield LastFirst
    unregister(LastFirst.name)


def test_a_policy_from_one_file_is_built_read_and_routes(last_first: type[LastFirst]) -> None:
    before = last_first.built
    assert needs_of("last_first") == Needs(blocks=True)
    assert last_first.built == before, "its needs are read without building it"
    assert "last_first" in policy_names() and "last_first" not in POLICIES
    policy = make_policy("last_first", balance_factor=2)
    assert isinstance(policy, LastFirst) and policy.options.balance_factor == 2.0
    router = Router(make_pool(3), policy)
    ctx = make_ctx("s", chain("p", 4))
    assert pick(router, ctx).name == "r2"
    assert pick(router, ctx, tried=["r2"]).name == "r1"


def test_unknown_names_and_options_say_what_is_registered(last_first: type[LastFirst]) -> None:
    with pytest.raises(
        ValueError, match="available: prefix_affinity, session_hash, least_loaded, round_robin"
    ):
        make_policy("nope")
    with pytest.raises(ValueError, match="last_first"):
        needs_of("nope")
    with pytest.raises(ValueError, match="known: balance_factor"):
        make_policy("round_robin", vnodes=3)


def test_another_class_cannot_take_a_registered_name() -> None:
    class Impostor:
        name: ClassVar[str] = "round_robin"
        needs: ClassVar[Needs] = Needs()

        @classmethod
        def from_options(cls, options: PolicyOptions) -> Impostor:
            return cls()

        def order(self, request: RouteRequest, candidates: Sequence[Rank]) -> list[Rank]:
            return list(candidates)

    with pytest.raises(ValueError, match="registered already"):
        register(Impostor)
    assert make_policy("round_robin").name == "round_robin"


def test_builtin_needs() -> None:
    assert POLICIES == ("prefix_affinity", "session_hash", "least_loaded", "round_robin")
    assert needs_of("prefix_affinity") == Needs(blocks=True, prefix_index=True)
    assert needs_of("least_loaded") == Needs(blocks=True)
    assert needs_of("session_hash") == Needs() and needs_of("round_robin") == Needs()


def names(ranks: Sequence[Rank]) -> list[str]:
    return [r.name for r in ranks]


def ranks(*in_flight: int) -> list[Rank]:
    return [Rank(f"r{i}", f"http://127.0.0.1:{i + 1}", in_flight=n) for i, n in enumerate(in_flight)]


def test_round_robin_advances_once_per_order() -> None:
    policy = make_policy("round_robin")
    fleet = ranks(0, 0, 0)
    orders = [names(policy.order(RouteRequest(), fleet)) for _ in range(4)]
    assert orders == [["r0", "r1", "r2"], ["r1", "r2", "r0"], ["r2", "r0", "r1"], ["r0", "r1", "r2"]]


def test_least_loaded_orders_by_load_then_queued_prefill() -> None:
    policy = make_policy("least_loaded")
    request = RouteRequest(queued_prefill={"r0": 500, "r2": 10})
    assert names(policy.order(request, ranks(1, 3, 1, 0))) == ["r3", "r2", "r0", "r1"]


def test_prefix_affinity_orders_by_score_and_puts_ranks_over_the_bound_last() -> None:
    policy = make_policy("prefix_affinity")
    hashes = chain("p", 10)
    fleet = ranks(0, 0, 5, 0)  # r2 holds the most but is over the bound (2 with 5 in flight over 4)
    request = RouteRequest("s", 165, hashes, {"r0": 4, "r1": 8, "r2": 10})
    assert names(policy.order(request, fleet)) == ["r1", "r0", "r3", "r2"]
    # a known session stays first on its rank, the others keep the score order behind it
    request.session_rank = "r3"
    assert names(policy.order(request, fleet)) == ["r3", "r1", "r0", "r2"]


def test_prefix_affinity_keeps_a_home_first_even_over_the_bound() -> None:
    policy = make_policy("prefix_affinity")
    fleet = [
        Rank(f"r{i}", "http://127.0.0.1:1", pool_tokens=100_000, in_flight=n) for i, n in enumerate((6, 0))
    ]
    request = RouteRequest("s", 165, chain("p", 10), {"r1": 10}, home_rank="r0")
    assert names(policy.order(request, fleet)) == ["r0", "r1"]
    request.inflight_tokens = {"r0": 100_000}  # its requests in flight fill its pool: still home
    request.queued_prefill = {"r0": 50_000}
    assert names(policy.order(request, fleet)) == ["r0", "r1"]
    unknown = [Rank(r.name, r.url, in_flight=r.in_flight) for r in fleet]  # pools not known
    assert names(policy.order(request, unknown)) == ["r1", "r0"]  # over the bound, r1 scores better


@pytest.mark.parametrize("policy", ["prefix_affinity", "session_hash"])
def test_a_sticky_policys_second_is_where_it_goes_without_the_first(policy: str) -> None:
    pool = list(make_pool(5))
    for i in range(30):
        hashes = chain(f"s{i}", 6)
        request = RouteRequest(f"s{i}", 101, hashes, {"r1": 3, "r3": i % 6, "r4": 6 - i % 6})
        order = make_policy(policy).order(request, pool)
        assert sorted(names(order)) == names(pool)
        rest = [r for r in pool if r is not order[0]]
        assert make_policy(policy).order(request, rest)[0] is order[1]
