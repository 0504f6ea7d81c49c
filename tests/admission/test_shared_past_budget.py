"""A new session admitted where there is room, and also on a rank past its budget where it costs
less (``cost.choose``: "room within the budget; cheaper past it"), may go to that rank with the
claims shared in Redis too: one process grants what its count allowed, and replicas must decide as
one (a lockstep replay found sessions placed off their agent's head by three replicas only)."""

from __future__ import annotations

from proxy.admission.cost import Option, choose
from proxy.admission.room import Room
from tests.admission.test_shared_claims import BUDGET, TOKENS, Replica
from tests.helpers.redis_server import RedisServer


def test_the_cheaper_rank_past_its_budget_is_named_apart() -> None:
    with_room = Option("r0", 16_000, 0, 0, 0.0, 0.001)
    holding_its_head = Option("r1", 1_000, 0, 2_000, 500.0, 0.001)  # past its budget, but 15k hits
    choice = choose(Room(frozenset({"r0"})), [with_room, holding_its_head], 0.0, 30.0, False)
    assert choice.decision == "room" and choice.allowed == {"r0", "r1"}
    assert choice.past_budget == {"r1"} and "cheaper past it: r1" in choice.reason


def test_the_shared_claims_grant_the_rank_chosen_past_its_budget(redis_server: RedisServer) -> None:
    replica = Replica(redis_server.url, ranks=2)
    for n in range(3):  # r1's claims fill past its budget: no room there for a new session
        replica.claims.claim(f"old{n}", "r1", BUDGET // 2, None, 0)
    replica.link.flush()  # claims are written behind
    both = Room(frozenset({"r0", "r1"}))
    within = replica.admission._reserve("new", both, TOKENS)
    assert within.granted == {"r0"}  # the budget holds where nothing else was chosen
    replica.claims.release("new")
    replica.link.flush()
    chosen = replica.admission._reserve("new2", both, TOKENS, past_budget=frozenset({"r1"}))
    assert chosen.granted == {"r0", "r1"}
