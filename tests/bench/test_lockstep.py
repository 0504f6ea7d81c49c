"""``tests/helpers/lockstep.py``'s order: every request once, each session's in its own order,
sub-agents before the parent's request that waits for them, at most ``concurrency`` top-level
sessions at once."""

from __future__ import annotations

from bench.traces.sessions import TraceRequest, TraceSession
from tests.helpers.lockstep import Step, lockstep_order


def session(key: str, thinks: list[float], start: float = 0.0) -> TraceSession:
    requests = [TraceRequest((("b", n),), 64, 8, think_time_s=t) for n, t in enumerate(thinks)]
    return TraceSession(key, requests, start_s=start)


def names(order: list[Step]) -> list[str]:
    return [f"{s.key}{i}" for _, _, s, i in order]


def test_sessions_interleave_by_their_think_times() -> None:
    a, b = session("a", [0, 5, 5]), session("b", [0, 3, 3], start=1.0)
    assert names(lockstep_order([a, b], concurrency=2, max_think_s=60)) == [
        "a0",
        "b0",
        "b1",
        "a1",
        "b2",
        "a2",
    ]


def test_sub_agents_go_before_the_request_that_waits_for_them() -> None:
    parent = session("p", [0, 1, 1])
    parent.children[1] = [session("c", [0, 10]), session("d", [0, 2])]
    assert names(lockstep_order([parent], concurrency=1, max_think_s=60)) == [
        "p0",
        "c0",
        "d0",
        "d1",
        "c1",
        "p1",
        "p2",
    ]


def test_a_session_waits_for_a_free_slot_and_long_thinks_are_cut() -> None:
    a, b = session("a", [0, 100]), session("b", [0])
    order = lockstep_order([a, b], concurrency=1, max_think_s=60)
    assert names(order) == ["a0", "a1", "b0"]  # b starts when a is done
    assert [t for t, *_ in order] == [0.0, 60.0, 60.0]
