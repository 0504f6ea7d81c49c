"""Admission's clocks come from the traffic: the idle TTL from the think gaps, the rotation bound
from the requests' durations; configured values override; the same traffic 100x faster gives clocks
100x shorter."""

from __future__ import annotations

import pytest

from proxy.admission import AdmissionConfig
from proxy.admission.learned import MIN_DURATIONS, MIN_IDLE_TTL_S, WAIT_REQUESTS, LearnedTime
from proxy.config import DEFAULT_IDLE_TTL_S, DEFAULT_WAIT_S
from proxy.state.sessions import Session
from routing.samples import MIN_SAMPLES

LEARN = AdmissionConfig(idle_ttl=None, wait=None)


def traffic(scale: float = 1.0) -> LearnedTime:
    """Gaps of 1..40 s (one per second), requests of 1..20 s."""
    clocks = LearnedTime(LEARN)
    for i in range(1, 41):
        clocks.note_gap(i * scale)
    for i in range(1, 21):
        clocks.note_duration(i * scale)
    return clocks


def test_defaults_until_the_traffic_has_said_enough() -> None:
    clocks = LearnedTime(LEARN)
    assert clocks.idle_ttl() == DEFAULT_IDLE_TTL_S and clocks.wait_bound() == DEFAULT_WAIT_S
    assert not clocks.learned()
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
    fast = traffic(scale=0.01)  # the same traffic replayed 100x faster
    assert fast.idle_ttl() == MIN_IDLE_TTL_S  # 0.78 s learned: held at the floor
    assert fast.wait_bound() == pytest.approx(clocks.wait_bound() / 100)  # the rotation bound scales
    session = Session("s", created=0.0, last_seen=0.0)  # no gaps of its own: the population's stand in
    slow_release, fast_release = clocks.release_rule()(session), fast.release_rule()(session)
    assert slow_release == pytest.approx(2 * 39)
    assert fast_release == pytest.approx(slow_release / 100)  # the idle TTL's floor holds no seat


def test_configured_clocks_override_the_learned_ones() -> None:
    clocks = LearnedTime(AdmissionConfig(idle_ttl=7.0, wait=0.5))
    for i in range(1, 41):
        clocks.note_gap(float(i))
        clocks.note_duration(float(i))
    assert clocks.idle_ttl() == 7.0 and clocks.wait_bound() == 0.5 and clocks.learned()
