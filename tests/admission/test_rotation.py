"""Seats rotate: a session waiting past the rotation bound gets the seat of the resident quiet
longest (``rotation.choose_parked``), never one just seated or one in flight; a parked session's
next turn waits like a newcomer's and is seated again the same way."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence

from proxy.admission import Admission, AdmissionConfig
from proxy.admission.accounting import RankState
from proxy.admission.rotation import choose_parked, parkable, why_none
from proxy.apis.base import Usage
from proxy.context import Outcome
from proxy.state.memory import MemorySessionStore
from proxy.state.sessions import Session, SessionTable
from routing.ranks import Fleet, Rank
from tests.admission.test_release import BLOCK, FRACTION, POOL, TTL, Clock, ctx_for, make, turn

HOLD = 5.0


def resident(key: str, answered_at: float, *, turns: int = 3, client: str | None = None) -> Session:
    session = Session(key, created=0.0, last_seen=answered_at, rank="r0", turns=turns, client=client)
    session.answered_at = answered_at
    session.seated_at = 1.0
    return session


def full_rank(name: str, sessions: list[Session], size: int = 500, budget: int = 1000) -> RankState:
    state = RankState(name, 2000, budget, holds_tokens=2000)
    for session in sessions:
        state.lru.append((session, size))
        state.sessions += 1
        state.projected_tokens += size
        state.working_set_tokens += size
    return state


def choose(  # type: ignore[no-untyped-def]
    states: dict[str, RankState], need: int = 400, now: float = 100.0, cap: int | None = None, **kw
):
    offloading = kw.get("offloading", ())
    ranks = [Rank(name, f"http://{name}", block_size=16, offloads_kv=name in offloading) for name in states]
    waited, bound = kw.get("waited", HOLD), kw.get("bound", HOLD)
    tie, hits, weight = kw.get("tie", 0.5), kw.get("hits", {}), kw.get("weight", lambda c: 1.0)
    priority = kw.get("priority", 0)
    args = (now, waited, priority, bound, tie, hits, weight)
    return choose_parked(ranks, states, need, None, kw.get("head", 0), cap, *args)


def test_the_resident_quiet_longest_is_parked() -> None:
    parking = choose({"r0": full_rank("r0", [resident("a", 90.0), resident("b", 60.0)])})
    assert parking is not None and (parking.rank, parking.keys) == ("r0", ("b",))


def test_as_few_as_free_the_need_and_none_when_nothing_can() -> None:
    state = full_rank("r0", [resident("a", 90.0), resident("b", 60.0), resident("c", 80.0)], size=300)
    parking = choose({"r0": state}, need=500)  # 900 + 500 past a 1,000 budget: two must go
    assert parking is not None and parking.keys == ("b", "c")
    busy = resident("d", 50.0)
    busy.last_seen = 99.0  # a request in flight
    assert choose({"r0": full_rank("r0", [busy, resident("e", 98.0)])}, need=800) is None


def test_a_seat_not_yet_served_is_not_taken_back_one_that_served_may_be() -> None:
    now = 100.0
    unserved = resident("unserved", 40.0)
    unserved.seated_at = 50.0  # seated after its last answer: not answered since
    assert not parkable(unserved, now, 0.0)
    assert choose({"r0": full_rank("r0", [unserved])}) is None
    fresh = resident("fresh", 99.0)
    fresh.seated_at = now - HOLD / 2  # seated less than the bound ago, answered since
    assert parkable(fresh, now, 0.0) and not parkable(fresh, now, HOLD)
    parking = choose({"r0": full_rank("r0", [fresh, unserved])})  # the waiter has waited the bound
    assert parking is not None and parking.keys == ("fresh",)


def test_a_session_is_parked_once_the_waiter_has_waited_the_bound() -> None:
    cheap, dear = resident("cheap", 90.0), resident("dear", 60.0)  # dear is quiet longest
    early = choose({"r0": full_rank("r0", [cheap, dear])}, waited=2.0, bound=1.0)
    assert early is not None and early.keys == ("dear",)  # past the bound: the quiet longest goes
    assert choose({"r0": full_rank("r0", [cheap, dear])}, waited=0.5, bound=1.0) is None


def test_ties_go_to_the_most_service_for_the_client_keys_weight() -> None:
    light = resident("light", 60.2, turns=4, client="batch")
    heavy = resident("heavy", 60.4, turns=9, client="ide")  # quiet as long, within one 0.5 s tick
    parking = choose({"r0": full_rank("r0", [light, heavy])})
    assert parking is not None and parking.keys == ("heavy",)
    weights = {"ide": 4.0, "batch": 1.0}.get  # ide weighs 4: 9 / 4 is less service than 4 / 1
    parking = choose({"r0": full_rank("r0", [light, heavy])}, weight=lambda c: weights(c or "", 1.0))
    assert parking is not None and parking.keys == ("light",)


def test_a_higher_class_parks_a_lower_class_first_without_waiting() -> None:
    low, high = resident("low", 95.0), resident("high", 60.0)  # high is quiet longest
    low.priority, high.priority = 0, 5
    assert choose({"r0": full_rank("r0", [low, high])}, waited=0.0) is None  # an equal class waits
    parking = choose({"r0": full_rank("r0", [low, high])}, waited=0.0, priority=5)
    assert parking is not None and parking.keys == ("low",)  # outranked: parked at once, first
    parking = choose({"r0": full_rank("r0", [low, high])}, priority=0)  # past the bound, class 0
    assert parking is not None and parking.keys == ("low",)  # the lowest class still goes first


def test_among_ranks_the_fewest_parked_then_what_the_waiter_holds() -> None:
    two_needed = full_rank("r0", [resident(k, 10.0) for k in ("a", "b", "c")], size=300)
    one_needed = full_rank("r1", [resident("x", 90.0), resident("y", 80.0)])
    parking = choose({"r0": two_needed, "r1": one_needed}, need=500)
    assert parking is not None and parking.rank == "r1" and parking.keys == ("y",)
    other = full_rank("r2", [resident("p", 95.0), resident("q", 94.0)])
    parking = choose({"r1": one_needed, "r2": other}, hits={"r2": 30})
    assert parking is not None and parking.rank == "r2"  # it holds the waiter's prompt


def test_among_ranks_freeing_alike_one_keeping_parked_blocks_in_cpu_memory_goes_first() -> None:
    # each frees the waiter's need with one session; r3 holds more of the waiter's prompt
    offloading = full_rank("r1", [resident("x", 90.0), resident("y", 80.0)])
    holding = full_rank("r3", [resident("p", 95.0), resident("q", 94.0)])
    tiers_off = choose({"r1": offloading, "r3": holding}, hits={"r3": 30})
    assert tiers_off is not None and tiers_off.rank == "r3"
    # r1 keeps what its GPU evicts in CPU memory: its parked session reloads, not recomputes
    parking = choose({"r1": offloading, "r3": holding}, hits={"r3": 30}, offloading={"r1"})
    assert parking is not None and (parking.rank, parking.keys) == ("r1", ("y",))
    # parking fewer still comes first: two there against one elsewhere
    two_needed = full_rank("r0", [resident(k, 10.0) for k in ("a", "b", "c")], size=300)
    parking = choose({"r0": two_needed, "r3": holding}, need=500, offloading={"r0"})
    assert parking is not None and parking.rank == "r3"


def test_a_waiter_back_to_its_own_blocks_on_an_offloading_rank_does_not_wait_the_bound() -> None:
    def rank() -> RankState:
        return full_rank("r0", [resident("a", 90.0), resident("b", 60.0)])

    early = {"waited": 0.5}  # far within the bound
    assert choose({"r0": rank()}, **early) is None
    # r0 offloads, but the waiter holds nothing there past a 64-token head: it waits as anyone
    assert choose({"r0": rank()}, offloading={"r0"}, hits={"r0": 4}, head=64, **early) is None
    # back to its own blocks on r0 (10 blocks of 16 tokens past a 64-token head): parked at once
    parking = choose({"r0": rank()}, offloading={"r0"}, hits={"r0": 10}, head=64, **early)
    assert parking is not None and parking.keys == ("b",)
    # the same waiter on a rank without a CPU tier waits the bound
    assert choose({"r0": rank()}, hits={"r0": 10}, head=64, **early) is None
    # a session that has not served since its seat is still not taken back
    fresh = resident("c", 60.0)
    fresh.seated_at = 70.0
    parking = choose({"r0": full_rank("r0", [fresh])}, offloading={"r0"}, hits={"r0": 10}, **early)
    assert parking is None
    # nor one that served but has held its seat less than the bound: two sessions back to their own
    # blocks on one rank would park each other at every turn
    just = resident("d", 99.9)
    just.seated_at = 99.0  # seated 1 s ago, answered since, quiet 0.1 s
    parking = choose({"r0": full_rank("r0", [just])}, 600, offloading={"r0"}, hits={"r0": 10}, **early)
    assert parking is None
    held = resident("e", 99.9)  # seated long ago
    parking = choose({"r0": full_rank("r0", [held])}, 600, offloading={"r0"}, hits={"r0": 10}, **early)
    assert parking is not None and parking.keys == ("e",)


def test_a_rank_at_its_session_cap_parks_for_a_place() -> None:
    state = full_rank("r0", [resident("a", 90.0), resident("b", 70.0)], size=100)
    parking = choose({"r0": state}, need=100, cap=2)  # tokens fit, places do not
    assert parking is not None and parking.keys == ("b",)
    assert choose({"r0": state}, need=100, cap=3) is None  # room as is: nothing to park


async def test_sessions_that_outgrow_their_rank_are_parked_quiet_longest_first() -> None:
    adm, clock = make()  # one rank: a pool of 2,000 tokens, a budget of 1,600
    for key in ("a", "b", "c"):
        await turn(adm, key, 500)
        clock.now += 1
    grown = ctx_for("c", 1100)  # c's next turn, in flight: 500 + 500 + 1,100 past the pool
    grown.admitted = await adm.admit(grown)
    adm.placed(grown, adm.fleet.get("r0"))  # type: ignore[arg-type]
    states = adm.refresh()  # what the timer does
    a = adm.table.get("a")
    assert a is not None and a.released and a.parks == 1
    assert a.admission is not None and "outgrew its pool" in a.admission["reason"]
    assert {s.key for s in adm.table.active()} == {"b", "c"}  # one parked was enough; c is in flight
    assert states["r0"].working_set_tokens <= POOL  # b (its 500 tokens and 16 answered) and c
    adm.finished(Outcome(grown, "r0", 200, Usage(1100, 16, 0)))
    rank = adm.fleet.get("r0")
    assert rank is not None
    rank.pool_tokens = 1000  # the rank came back with less memory: b and c are both past it
    adm.refresh()
    assert [s.key for s in adm.table.active()] == ["c"]  # b parked; the last session never is


async def test_waiters_past_the_bound_each_get_a_seat_and_a_parked_session_resumes() -> None:
    adm, clock = make(wait=0.05)  # one rank, budget 1,600 tokens: two 700-token sessions
    for key in ("a", "b"):
        await turn(adm, key, 700)
        clock.now += 1
    clock.now += 10  # both quiet, both past the hold
    waiters = [asyncio.ensure_future(adm.admit(ctx_for(key, 700))) for key in ("c", "d")]
    done = await asyncio.wait_for(asyncio.gather(*waiters), 5)
    assert [d.seat.decision for d in done] == ["rotated", "rotated"]  # type: ignore[union-attr]
    assert [d.seat.parked for d in done] == [("a",), ("b",)]  # type: ignore[union-attr]
    for ctx_key, admitted in zip(("c", "d"), done, strict=True):
        ctx = ctx_for(ctx_key, 700)
        ctx.admitted = admitted
        adm.placed(ctx, adm.fleet.get("r0"))  # type: ignore[arg-type]
    a = adm.table.get("a")
    assert a is not None and a.released and a.parks == 1 and a.admission["decision"] == "parked"  # type: ignore[index]
    assert {s.key for s in adm.table.active()} == {"c", "d"}
    # a comes back: c and d were seated a moment ago and have not been answered: nobody is parked
    back = asyncio.ensure_future(adm.admit(ctx_for("a", 760)))
    await asyncio.sleep(0.2)
    assert not back.done() and len(adm.queue) == 1
    for key in ("c", "d"):
        ctx = ctx_for(key, 700)
        ctx.admitted = next(d for d in done if d.session is not None and d.session.key == key)
        adm.finished(Outcome(ctx, "r0", 200, Usage(700, 16, 0)))
        clock.now += 1
    clock.now += 10  # answered, quiet and held a bound: c (answered first) gives its seat back
    adm.queue.notify()
    resumed = await asyncio.wait_for(back, 5)
    assert resumed.seat is not None and resumed.seat.decision == "rotated" and resumed.seat.parked == ("c",)
    assert resumed.session is not None and resumed.session.admission["resumed"] is True  # type: ignore[index]


async def test_admission_says_each_seat_and_park_in_a_sentence_naming_one_rank(caplog) -> None:  # type: ignore[no-untyped-def]
    adm, clock = make(ranks=2, wait=0.05)
    caplog.set_level(logging.INFO, logger="prefixgate.admission")
    for key in ("a", "b", "c", "d"):  # two per rank fill both budgets
        await turn(adm, key, 700)
        clock.now += 1
    clock.now += 10
    await turn(adm, "e", 700)
    lines = [r.getMessage() for r in caplog.records if r.name == "prefixgate.admission"]
    assert lines and not any("None" in line for line in lines)
    seated = [line for line in lines if " seated on " in line]
    assert len(seated) == 5 and all(re.search(r" seated on r[01] after waiting ", line) for line in seated)
    assert any(
        re.match(r"session a parked on r0 after 1 turns: parked for session e", line) for line in lines
    )


class Holding:
    """Routing's view for admission: the leading blocks of any prompt each rank holds."""

    def __init__(self, blocks: dict[str, int]) -> None:
        self.blocks = blocks

    def holds(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        return dict(self.blocks)

    def queued(self, rank: str) -> int:
        return 0


async def test_a_session_back_to_its_offloaded_context_parks_there_rather_than_move() -> None:
    """Room on another rank would recompute its whole context there; a quiet session parked on
    the rank that keeps the waiter's context in CPU memory costs a reload instead (issue 47: no
    session moves off a rank holding its blocks in CPU memory)."""
    clock = Clock()
    table = SessionTable(MemorySessionStore(), TTL, clock)
    # r0 keeps what its GPU evicts in a CPU tier: 2,000 + 1,000 tokens, a budget of 2,400
    fleet = Fleet(
        [
            Rank("r0", "http://r0", pool_tokens=POOL, offloads_kv=True, cpu_tier_tokens=1000),
            Rank("r1", "http://r1", pool_tokens=POOL),
        ]
    )
    config = AdmissionConfig(idle_ttl=TTL, wait=5.0, block_size=BLOCK, target_fraction=FRACTION)
    placement = Holding({"r0": 50})  # 800 tokens of the returning prompt, past its 64-token head
    adm = Admission(table, fleet, config, None, placement)
    for key in ("a", "b", "back"):
        await turn(adm, key, 700, head=b"H", head_tokens=64)  # all three on r0 (the first allowed)
        clock.now += 1
    assert {s.rank for s in adm.table.active()} == {"r0"}
    adm.release("back")  # parked (or freed): its context stays in r0's tiers
    await turn(adm, "c", 700, head=b"H", head_tokens=64)  # r0 is full again, r1 still empty
    assert adm.table.get("c").rank == "r0"  # type: ignore[union-attr]
    clock.now += 10  # a, b and c quiet, answered since their seats
    admitted = await asyncio.wait_for(adm.admit(ctx_for("back", 760, head=b"H", head_tokens=64)), 5)
    assert admitted.seat is not None and admitted.seat.decision == "rotated"
    assert admitted.allowed == {"r0"} and admitted.seat.parked == ("a",)  # quiet longest
    # a new session, of which r0 holds the head only, takes the room on r1 as before
    placement.blocks = {"r0": 4}
    fresh = await asyncio.wait_for(adm.admit(ctx_for("new", 700, head=b"H", head_tokens=64)), 5)
    assert fresh.allowed == {"r1"} and fresh.seat is not None and fresh.seat.decision == "room"


def test_why_no_rotation_could_seat_a_waiter() -> None:
    busy = resident("busy", 90.0)
    busy.last_seen = 95.0  # its latest request, sent after its last answer, is in flight
    assert why_none({"r0": full_rank("r0", [busy])}, 100.0) == "busy"
    fresh = resident("fresh", 97.0)
    fresh.seated_at = 98.0  # quiet, but seated after its last answer: not answered since
    assert why_none({"r0": full_rank("r0", [busy, fresh])}, 100.0) == "unserved"
    # one that may be parked, yet choose_parked found none: it frees too little
    assert why_none({"r0": full_rank("r0", [busy, fresh, resident("old", 60.0)])}, 100.0) == "short"
    assert choose({"r0": full_rank("r0", [busy, fresh, resident("old", 60.0)])}, need=900) is None
