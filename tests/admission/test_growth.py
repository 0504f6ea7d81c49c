"""Admission reserves room for how far sessions grow (learned from the sessions that ended), and tells
the router which rank an admitted session lives on."""

from __future__ import annotations

import logging

import pytest

from proxy.admission.learned import PeakEstimator
from tests.admission.test_release import TTL, ctx_for, make, turn, waits


def test_expected_peak_is_the_mean_of_the_peaks_that_reached_the_current_size() -> None:
    peaks = PeakEstimator()
    assert peaks.expected_peak(500) == 500  # nothing ended yet: no growth assumed
    for peak in (1000, 2000, 3000):
        peaks.add(peak)
    assert peaks.expected_peak(500) == 2000
    assert peaks.expected_peak(1500) == 2500  # the 1,000-token session never got this large
    assert peaks.expected_peak(3000) == 3000
    assert peaks.expected_peak(3500) == 3500  # larger than any seen: as large as it is


def test_expected_peak_follows_the_most_recent_sessions_only() -> None:
    peaks = PeakEstimator(window=2)
    for peak in (9000, 1000, 2000):
        peaks.add(peak)
    assert len(peaks) == 2
    assert peaks.expected_peak(0) == 1500
    with pytest.raises(ValueError):
        PeakEstimator(window=0)


async def test_sessions_that_ended_feed_the_estimate() -> None:
    adm, clock = make()
    await turn(adm, "a", 300)
    await turn(adm, "a", 900)  # 916 tokens held after the answer
    adm.refresh()
    clock.now += TTL + 1  # a idles out
    adm.refresh()
    assert len(adm.peaks) == 1 and adm.peaks.expected_peak(0) == 916


async def test_a_rank_takes_new_sessions_only_with_room_for_their_expected_growth() -> None:
    adm, clock = make(ranks=2)
    # earlier sessions grew to 1,000 tokens each before they ended
    for key in ("old1", "old2"):
        await turn(adm, key, 400)
        await turn(adm, key, 984)
    adm.refresh()
    clock.now += TTL + 1
    adm.refresh()
    assert adm.peaks.expected_peak(300) == 1000
    first = await turn(adm, "a", 300)
    assert first.admitted.allowed == {"r0", "r1"}
    states = adm.refresh()
    assert states["r0"].working_set_tokens == 316 and states["r0"].projected_tokens == 1000
    # 316 + 300 tokens fit r0's 1,600-token budget today, but not two sessions grown to 1,000
    second = await turn(adm, "b", 300)
    assert second.admitted.allowed == {"r1"}
    await waits(adm, "c", 300)  # both ranks are spoken for


async def test_released_sessions_are_not_taken_for_ended_ones() -> None:
    adm, clock = make()
    await turn(adm, "a", 600)
    clock.now += 1
    await turn(adm, "a", 700)
    clock.now += 100  # idle far past its think gaps: reclaimable
    adm.refresh()
    new = ctx_for("b", 1000)
    new.admitted = await adm.admit(new)  # a is released for it
    adm.placed(new, adm.fleet.get("r0"))  # type: ignore[arg-type]
    adm.refresh()
    assert len(adm.peaks) == 0


async def test_an_admitted_session_is_homed_on_its_rank_a_new_one_is_not() -> None:
    adm, _ = make(ranks=2)
    first = await turn(adm, "a", 300)
    assert first.admitted.home is None and first.admitted.allowed is not None
    again = ctx_for("a", 400)
    again.admitted = await adm.admit(again)
    assert again.admitted.home == first.admitted.session.rank
    off, _ = make(ranks=2, enabled=False)
    await turn(off, "a", 300)
    unmanaged = ctx_for("a", 400)
    unmanaged.admitted = await off.admit(unmanaged)
    assert unmanaged.admitted.home is None  # without admission the router's load bound still applies


async def test_the_smallest_session_covering_the_excess_moves_off_an_outgrown_rank(
    caplog: pytest.LogCaptureFixture,
) -> None:
    adm, _ = make(ranks=2)
    await turn(adm, "a", 300)
    assert (await turn(adm, "b", 300)).admitted.session.rank == "r0"  # type: ignore[union-attr]  # both admitted on r0 while small
    grown = await turn(adm, "a", 1200)
    assert grown.admitted.allowed is None and grown.admitted.home == "r0"  # 1,216 + 316: within the pool
    with caplog.at_level(logging.INFO, logger="prefixgate.admission"):
        moving = await turn(adm, "b", 1000)  # 1,216 + 1,000 > 2,000: b is the smallest covering the excess
    assert moving.admitted.allowed == {"r1"} and moving.admitted.home is None
    assert "session b re-homed before its turn 1: r0 holds 216 tokens past its pool of 2000" in caplog.text
    assert adm.table.get("b").rank == "r1"  # type: ignore[union-attr]
    staying = await turn(adm, "a", 1300)
    assert staying.admitted.allowed is None and staying.admitted.home == "r0"


async def test_nobody_moves_when_no_other_rank_has_room() -> None:
    adm, _ = make(ranks=1)
    await turn(adm, "a", 300)
    await turn(adm, "b", 300)
    await turn(adm, "a", 1200)
    stuck = await turn(adm, "b", 1000)
    assert stuck.admitted.allowed is None and stuck.admitted.home == "r0"
