"""``prefixgate bench --rounds``: systems in a rotated order, each figure the median of its rounds."""

from __future__ import annotations

from typing import Any

import pytest

from bench.rounds import combine, combine_all, rotation


def _summary(hit: float, p99: float, errors: int = 0, wall: float = 10.0) -> dict[str, Any]:
    return {
        "hit_rate": hit,
        "ttft_p99_ms": p99,
        "errors": errors,
        "rejections": 0,
        "wall_s": wall,
        "requests": 806,
        "turns": [{"hit": hit}],
        "rank_counters": {"vllm:prefix_cache_hits": hit},
    }


def test_each_round_rotates_the_order_so_no_system_always_runs_first() -> None:
    systems = ["plain", "prefixgate", "sglang"]
    firsts = [rotation(systems, i)[0] for i in range(3)]
    assert firsts == ["plain", "prefixgate", "sglang"]
    assert all(sorted(rotation(systems, i)) == sorted(systems) for i in range(5))
    assert rotation([], 3) == []


def test_each_figure_is_the_median_of_its_own_column() -> None:
    rounds = [
        _summary(0.68, 300.0, wall=14.0),
        _summary(0.84, 450.0, wall=15.0),
        _summary(0.81, 320.0, wall=16.0),
    ]
    combined = combine(rounds)
    assert combined["hit_rate"] == 0.81
    assert combined["ttft_p99_ms"] == 320.0  # from another round than the median hit rate
    assert combined["wall_s"] == 15.0
    assert combined["requests"] == 806 and isinstance(combined["requests"], int)
    # the turns and counters are the median-hit round's, whole
    assert combined["turns"] == [{"hit": 0.81}]
    assert combined["rank_counters"] == {"vllm:prefix_cache_hits": 0.81}
    assert [r["hit_rate"] for r in combined["rounds"]] == [0.68, 0.84, 0.81]
    assert all("turns" not in r for r in combined["rounds"])


def test_errors_are_the_worst_rounds_not_the_median() -> None:
    combined = combine([_summary(0.8, 300.0), _summary(0.8, 300.0, errors=3), _summary(0.8, 300.0)])
    assert combined["errors"] == 3


def test_failed_rounds_are_left_out_and_all_failed_is_a_failure() -> None:
    combined = combine([{"failed": "boom"}, _summary(0.7, 300.0), _summary(0.9, 500.0)])
    assert combined["hit_rate"] == pytest.approx(0.8)
    assert combined["rounds"][0] == {"failed": "boom"}
    failed = combine([{"failed": "a"}, {"failed": "b"}])
    assert failed["failed"] == "a; b"
    with pytest.raises(ValueError):
        combine([])


def test_every_system_keeps_the_first_rounds_order() -> None:
    first = {"plain": _summary(0.5, 1.0), "prefixgate": _summary(0.8, 1.0)}
    second = {"prefixgate": _summary(0.9, 1.0), "plain": _summary(0.6, 1.0)}
    combined = combine_all([first, second])
    assert list(combined) == ["plain", "prefixgate"]
    assert combined["prefixgate"]["hit_rate"] == pytest.approx(0.85)
