"""A new session never waits longer than admitting it at once would delay its own first token
(``cost.choose``): past that delay, or when room is expected only after it, it goes in on the least
costly ranks, whatever its waiting would spare the others."""

from __future__ import annotations

import asyncio

import pytest

from proxy.admission.cost import Choice, Option, choose
from proxy.admission.room import Room
from tests.admission.test_cost import make, teach_speed, turn
from tests.admission.test_release import ctx_for

NO_ROOM = Room(frozenset())
BOUND = 30.0


def compute_bound(room_in_s: float, spt: float | None = 0.001) -> Option:
    """One rank, 1 s from a first token at 1,000 tokens/s (900 queued, 100 its own), whose evictions
    cost 5 s of recompute: waiting for room that comes in ``room_in_s`` is cheaper than that."""
    return Option("r0", 100, 900, 5_000, 5_000.0, spt, ((room_in_s, 1.0),))


def decide(option: Option, waited_s: float, learned: bool = True, unmeasured: float | None = None) -> Choice:
    return choose(NO_ROOM, [option], waited_s, BOUND, False, learned, unmeasured_start_s=unmeasured)


def test_the_delay_to_a_first_token_is_the_queued_prefill_then_its_own() -> None:
    assert compute_bound(0.5).start_s == pytest.approx(1.0)
    assert compute_bound(0.5, spt=None).start_s is None


def test_room_coming_before_that_delay_is_waited_for() -> None:
    choice = decide(compute_bound(0.5), waited_s=0.0)
    assert not choice.admit and choice.decision == "wait"
    assert "cheaper than recomputing" in choice.reason


def test_room_coming_only_after_that_delay_does_not_hold_it() -> None:
    """Within the 30 s bound room comes at 2 s, and the evictions cost 5 s: the old rule waited.
    But the session's first token would wait only 1 s if it went in now."""
    choice = decide(compute_bound(2.0), waited_s=0.0)
    assert choice.admit and choice.decision == "over_budget" and choice.allowed == {"r0"}
    assert "room within the 1 s it may still wait 0% likely" in choice.reason
    assert "its first token would wait 1 s if admitted now" in choice.reason


def test_a_wait_ends_once_it_is_as_long_as_that_delay() -> None:
    option = compute_bound(0.05)  # room 50 ms from now, at every decision
    assert not decide(option, waited_s=0.9).admit  # 0.1 s of its wait left: room comes within it
    choice = decide(option, waited_s=1.0)
    assert choice.admit and choice.decision == "over_budget"
    assert "waited 1 s, as long as its first token would wait if admitted now (1 s" in choice.reason


def test_before_the_clocks_are_learned_the_budget_holds_only_that_long() -> None:
    option = compute_bound(0.5)
    held = decide(option, waited_s=0.2, learned=False)
    assert not held.admit and "the clocks are not learned yet" in held.reason
    assert decide(option, waited_s=1.0, learned=False).admit


def test_unmeasured_ranks_hold_a_typical_request_long_then_up_to_the_bound_without_one() -> None:
    option = compute_bound(0.5, spt=None)
    assert not decide(option, waited_s=0.2, unmeasured=0.4).admit
    late = decide(option, waited_s=0.4, unmeasured=0.4)
    assert late.admit and "a typical request's duration" in late.reason
    assert not decide(option, waited_s=20.0).admit  # nothing known at all: the budget holds


async def test_a_full_rank_holds_a_new_session_only_as_long_as_its_first_token_would_wait() -> None:
    """Through admission, before any think gap is seen (the clocks not learned: the old rule held
    the budget up to the 30 s bound): r0's budget is full, and at 10,000 tokens/s a 700-token session
    would have its first token in 70 ms if admitted now."""
    adm, _, _ = make(wait=BOUND, idle_ttl=None)
    teach_speed(adm, "r0", 10_000)
    for key in ("a", "b"):
        await turn(adm, key, 784)  # 1,568 of r0's 1,600-token budget
    assert not adm.time.learned()
    new = ctx_for("c", 700)
    waiting = asyncio.ensure_future(adm.admit(new))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiting.done() and len(adm.queue) == 1  # no room: it waits at first
    new.admitted = await asyncio.wait_for(waiting, 10)
    record = new.admitted.session.admission  # type: ignore[union-attr]
    (option,) = record["options"]
    assert option["start_s"] == pytest.approx(0.07)
    assert record["decision"] == "over_budget" and "as long as its first token would wait" in record["reason"]
    assert new.admitted.waited_s >= option["start_s"] and new.admitted.allowed == {"r0"}
