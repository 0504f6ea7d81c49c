"""The population's think gaps stand in for a session's own while it has shown few: a one-request
session no longer holds its room for the whole idle TTL, a session with one short gap is not judged
ended after twice that gap."""

from __future__ import annotations

import random

import pytest

from proxy.admission import AdmissionConfig
from proxy.admission.learned import OWN_EVIDENCE, ThinkGaps, release_after
from proxy.state.sessions import Session
from routing.samples import MIN_SAMPLES
from tests.admission.test_release import TTL, make, turn


def test_quantile_needs_enough_gaps_and_follows_the_recent_ones() -> None:
    gaps = ThinkGaps(window=100, min_samples=10)
    for g in range(9):
        gaps.add(float(g))
    assert gaps.quantile(0.95) is None
    gaps.add(9.0)
    assert gaps.quantile(0.5) == 5.0 and gaps.quantile(0.95) == 9.0
    for _ in range(100):  # the window forgets the old ones
        gaps.add(1.0)
    assert gaps.quantile(0.95) == 1.0
    with pytest.raises(ValueError):
        ThinkGaps(window=0)


def session_with_gaps(*gaps: float) -> Session:
    s = Session("s", created=1.0, last_seen=1.0)
    now = 1.0  # answered_at 0 means never answered
    for gap in gaps:
        s.answered_at = s.last_seen = now
        now += gap
        s.note_request(now)
    s.answered_at = now
    return s


def test_release_after_uses_the_typical_gap_until_the_session_has_its_own_evidence() -> None:
    config = AdmissionConfig(idle_ttl=TTL)
    fresh = session_with_gaps()
    assert release_after(config, fresh) == TTL  # nothing known at all: the idle TTL, as before
    assert release_after(config, fresh, typical_gap=40.0) == 80.0  # 2 x the population's long gap
    one_short = session_with_gaps(20.0)
    assert release_after(config, one_short) == 40.0  # its own single gap alone
    assert release_after(config, one_short, typical_gap=40.0) == 80.0  # not judged by it alone
    one_long = session_with_gaps(60.0)
    assert release_after(config, one_long, typical_gap=40.0) == 120.0  # its own when longer
    seasoned = session_with_gaps(*[20.0] * OWN_EVIDENCE)
    assert release_after(config, seasoned, typical_gap=100.0) == 40.0  # enough of its own: those


async def test_a_one_request_session_is_reclaimable_after_twice_the_typical_gap() -> None:
    adm, clock = make(ranks=1)
    # many sessions think ~20 s between turns: the typical long gap is 20 s
    for i in range(MIN_SAMPLES):
        key = f"agent{i}"
        await turn(adm, key, 10)
        clock.now += 20
        await turn(adm, key, 20)
        adm.release(key)
    assert adm.typical_gap() == pytest.approx(20.0)
    await turn(adm, "one-shot", 900)  # a single request, then nothing
    clock.now += 39  # under 2 x 20 s
    assert adm.refresh()["r0"].reclaimable == []
    clock.now += 2  # past 2 x 20 s, long before the 300 s idle TTL it was held for before
    assert [s.key for s, _ in adm.refresh()["r0"].reclaimable] == ["one-shot"]


def test_quantiles_match_the_window_sorted_afresh() -> None:
    """The sorted copy kept gap by gap (insertions, and removals once the window is full, duplicates
    included) answers as sorting the window afresh would."""
    rng = random.Random(22)
    window = 30
    gaps = ThinkGaps(window=window, min_samples=1)
    added: list[float] = []
    for i in range(600):
        gap = rng.choice([rng.random() * 10, 1.0, 2.0, float(i % 5)])
        gaps.add(gap)
        added.append(gap)
        ordered = sorted(added[-window:])
        q = rng.random()
        assert gaps.quantile(q) == ordered[min(len(ordered) - 1, int(q * len(ordered)))]
    gaps.add(-1.0)  # refused: the window is unchanged
    assert gaps.quantile(0.0) == min(added[-window:])
