"""Once sessions' lifetimes are learned, the ``cost`` policy predicts room from when the sessions on
a full rank will have ended (several of them, one after another), waits only while that room is
due within the bound and cheaper than evicting, and stops waiting when the room it expected did
not come."""

from __future__ import annotations

import asyncio
import math

import pytest

from proxy.admission import Admission, AdmissionConfig
from proxy.admission.accounting import RankState
from proxy.admission.cost import room_at
from proxy.admission.timing import MIN_ENDED, LearnedTime
from proxy.state.sessions import Session
from tests.admission.test_cost import make, teach_speed, turn, two_thinkers
from tests.admission.test_release import ctx_for


def test_room_comes_from_several_sessions_ending_one_after_another() -> None:
    ends = {"a": 5.0, "b": 8.0, "c": 12.0}
    state = RankState("r0", 2000, 1600)
    state.lru = [(Session(key, created=0.0, last_seen=0.0), 500) for key in ("c", "a", "b")]

    def expected_end(session: Session) -> float:
        return ends[session.key]

    # no single session frees 800 tokens: a and b together do, once b has ended too
    assert room_at(state, 800, 1.0, expected_end) == pytest.approx(7.0)
    assert room_at(state, 1500, 1.0, expected_end) == pytest.approx(11.0)
    assert room_at(state, 1501, 1.0, expected_end) is None  # not even all three would free it
    assert room_at(state, 0, 1.0, expected_end) == 0.0


def test_a_sessions_remaining_life_is_that_of_the_sessions_that_lived_as_long() -> None:
    clocks = LearnedTime(AdmissionConfig(idle_ttl=None, wait=None))
    lifetimes = [10.0, 20.0, 30.0, 40.0, 50.0]
    for life in lifetimes[: MIN_ENDED - 1]:
        clocks.note_released(turns=3, lifetime_s=life)
    assert not clocks.lifetimes_known() and clocks.remaining_life(0.0) is None
    for life in lifetimes[MIN_ENDED - 1 :]:
        clocks.note_end(turns=3, lifetime_s=life)
    assert clocks.lifetimes_known()
    assert clocks.remaining_life(0.0) == pytest.approx(30.0)
    assert clocks.remaining_life(25.0) == pytest.approx(15.0)  # 30, 40 and 50 s lived past 25 s
    assert clocks.remaining_life(60.0) == 0.0  # older than any: due to end
    assert clocks.turns_per_session() == 3  # released sessions' turns count too


def teach_lifetimes(adm: Admission, seconds: float) -> None:
    for _ in range(MIN_ENDED):
        adm.time.note_released(turns=4, lifetime_s=seconds)


async def test_room_due_after_the_bound_admits_past_the_budget_at_once() -> None:
    adm, clock, _ = make(wait=5.0)
    teach_speed(adm, "r0", 100)  # compute-bound: evicting costs more than waiting would
    await two_thinkers(adm, clock)
    teach_lifetimes(adm, 100.0)  # a and b, 3 s old, have about 97 s to live
    new = ctx_for("c", 700)
    new.admitted = await adm.admit(new)
    assert new.admitted.waited_s == 0 and new.admitted.allowed == {"r0"}
    record = new.admitted.session.admission  # type: ignore[union-attr]
    assert record["decision"] == "over_budget" and "no room is coming" in record["reason"]
    (option,) = record["options"]
    assert option["room_in_s"] > 90


async def test_a_wait_whose_room_does_not_come_when_expected_stops() -> None:
    adm, clock, _ = make()
    teach_speed(adm, "r0", 100)
    await two_thinkers(adm, clock)
    teach_lifetimes(adm, 3.0)  # a and b have lived as long as sessions do: room due in about 1 s
    new = ctx_for("c", 700)
    waiting = asyncio.ensure_future(adm.admit(new))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiting.done() and len(adm.queue) == 1  # room is due soon: cheaper to wait
    for _ in range(3):  # but a and b go on past it, answered every 0.6 s: still active
        clock.now += 0.6
        for key in ("a", "b"):
            await turn(adm, key, 768)
    adm.queue.notify()
    new.admitted = await asyncio.wait_for(waiting, 10)
    record = new.admitted.session.admission  # type: ignore[union-attr]
    assert record["decision"] == "over_budget" and "did not come" in record["reason"]
    assert new.admitted.allowed == {"r0"}


def test_a_session_older_than_every_lifetime_seen_has_no_known_end() -> None:
    clocks = LearnedTime(AdmissionConfig(idle_ttl=None, wait=None))
    assert not clocks.outlived(100.0)  # nothing learned: nothing to say
    for life in (10.0, 20.0, 30.0, 40.0, 50.0):
        clocks.note_end(turns=3, lifetime_s=life)
    assert not clocks.outlived(0.0) and not clocks.outlived(50.0)
    assert clocks.outlived(50.001) and clocks.outlived(600.0)


def test_room_is_never_due_from_a_session_whose_end_is_unknown() -> None:
    state = RankState("r0", 2000, 1600)
    state.lru = [(Session(key, created=0.0, last_seen=0.0), 500) for key in ("a", "b")]
    ends = {"a": 5.0, "b": math.inf}
    assert room_at(state, 400, 1.0, lambda s: ends[s.key]) == pytest.approx(4.0)
    assert room_at(state, 800, 1.0, lambda s: ends[s.key]) is None  # b's end is not known


async def test_sessions_older_than_every_lifetime_seen_promise_no_room() -> None:
    # early in the traffic only short sessions have ended: a and b (3 s old) have outlived them all,
    # so their end is unknown, not due; waiting for it would only delay c, then admit it anyway
    adm, clock, _ = make()
    teach_speed(adm, "r0", 100)  # compute-bound: evicting costs more than a short wait
    await two_thinkers(adm, clock)
    teach_lifetimes(adm, 1.0)
    new = ctx_for("c", 700)
    new.admitted = await asyncio.wait_for(adm.admit(new), 10)
    assert new.admitted.waited_s == 0 and new.admitted.allowed == {"r0"}
    assert new.admitted.session is not None
    record = new.admitted.session.admission
    assert record["decision"] == "over_budget" and "no room is coming" in record["reason"]
