"""``bench/wait_order.py``: what counts as a later arrival overtaking an earlier waiter."""

from __future__ import annotations

from typing import Any

from bench.wait_order import overtakes


def record(arrived: float, waited: float, decision: str = "room") -> dict[str, Any]:
    return {"at": arrived + waited, "waited_s": waited, "decision": decision}


def test_a_later_arrival_taking_room_before_an_earlier_waiter_is_one_overtake() -> None:
    assert overtakes([record(0.0, 5.0), record(1.0, 0.0)]) == 1


def test_served_in_arrival_order_is_none() -> None:
    assert overtakes([record(0.0, 5.0), record(1.0, 6.0), record(6.0, 2.0)]) == 0
    assert overtakes([record(0.0, 1.0), record(2.0, 0.0)]) == 0  # it arrived after the wait ended


def test_a_seat_taken_by_rotation_overtakes_too_a_park_does_not() -> None:
    assert overtakes([record(0.0, 5.0), record(1.0, 0.5, "rotated")]) == 1
    assert overtakes([record(0.0, 5.0), record(1.0, 0.0, "parked")]) == 0


def test_each_earlier_waiter_overtaken_counts() -> None:
    assert overtakes([record(0.0, 5.0), record(0.5, 5.0), record(1.0, 0.0)]) == 2
