"""Admission's clocks come from the traffic: the idle TTL from the think gaps, the wait bound from the
requests' durations, a quiet session's chance of returning from gaps and ends; configured values
override; the same traffic 100x faster gives clocks 100x shorter."""

from __future__ import annotations

import pytest

from proxy.admission import AdmissionConfig
from proxy.admission.config import DEFAULT_IDLE_TTL_S, DEFAULT_WAIT_S
from proxy.admission.think_gaps import MIN_SAMPLES
from proxy.admission.timing import MIN_DURATIONS, MIN_IDLE_TTL_S, P_ENDED, WAIT_REQUESTS, LearnedTime
from proxy.state.sessions import Session

LEARN = AdmissionConfig(idle_ttl=None, wait=None)


def traffic(scale: float = 1.0) -> LearnedTime:
    """Gaps of 1..40 s (one per second), each a session coming back, a session ending after every
    fourth gap, requests of 1..20 s."""
    clocks = LearnedTime(LEARN)
    for i in range(1, 41):
        clocks.note_gap(i * scale)
        clocks.note_returns(1)
        if i % 4 == 0:
            clocks.note_end(turns=5)
    for i in range(1, 21):
        clocks.note_duration(i * scale)
    return clocks


def test_defaults_until_the_traffic_has_said_enough() -> None:
    clocks = LearnedTime(LEARN)
    assert clocks.idle_ttl() == DEFAULT_IDLE_TTL_S and clocks.wait_bound() == DEFAULT_WAIT_S
    assert not clocks.learned()
    assert clocks.return_probability(1e6) == 1.0  # nothing known: every quiet session may return
    for _ in range(MIN_SAMPLES - 1):
        clocks.note_gap(1.0)
    for _ in range(MIN_DURATIONS - 1):
        clocks.note_duration(1.0)
    assert clocks.idle_ttl() == DEFAULT_IDLE_TTL_S and clocks.wait_bound() == DEFAULT_WAIT_S


def test_the_clocks_follow_the_traffic_and_scale_with_it() -> None:
    clocks = traffic()
    assert clocks.learned()
    assert clocks.idle_ttl() == pytest.approx(2 * 39)  # 2 x the 95th percentile gap
    assert clocks.wait_bound() == pytest.approx(WAIT_REQUESTS * 19)  # 4 x the 90th percentile request
    assert clocks.turns_per_session() == 5
    fast = traffic(scale=0.01)  # the same traffic replayed 100x faster
    assert fast.idle_ttl() == MIN_IDLE_TTL_S  # 0.78 s learned: held at the floor
    slow_end, fast_end = (c.ended_after(Session("s", created=0.0, last_seen=0.0)) for c in (clocks, fast))
    assert slow_end is not None and fast_end == pytest.approx(slow_end / 100)  # what frees room scales
    assert fast.wait_bound() == pytest.approx(clocks.wait_bound() / 100)
    assert fast.quiet_ended() == pytest.approx(clocks.quiet_ended() / 100)  # type: ignore[operator]


def test_a_quiet_session_is_less_likely_to_return_the_longer_it_is_quiet() -> None:
    clocks = traffic()
    chances = [clocks.return_probability(t) for t in (0.0, 10.0, 30.0, 39.5, 100.0)]
    assert chances == sorted(chances, reverse=True)
    assert chances[0] > 0.75 and chances[-1] == 0.0  # quieter than any gap seen: ended
    quiet = clocks.quiet_ended()
    assert quiet is not None and clocks.return_probability(quiet + 0.5) <= P_ENDED
    thinker = Session("s", created=0.0, last_seen=0.0, gaps=3, gap_max=50.0)
    assert clocks.ended_after(thinker) == 50.0  # it has been quiet that long before and came back


def test_configured_clocks_override_the_learned_ones() -> None:
    clocks = LearnedTime(AdmissionConfig(idle_ttl=7.0, wait=0.5))
    for i in range(1, 41):
        clocks.note_gap(float(i))
        clocks.note_duration(float(i))
    assert clocks.idle_ttl() == 7.0 and clocks.wait_bound() == 0.5 and clocks.learned()
