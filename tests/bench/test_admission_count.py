"""``bench.admission_count`` measures the tree it is given, every measure of every call."""

from __future__ import annotations

from pathlib import Path

from bench.admission_count import MEASURES, run_tree

ROOT = Path(__file__).resolve().parents[2]


def test_a_run_times_each_measure_once_per_call() -> None:
    data = run_tree(ROOT, sessions=20, ranks=2, calls=3)
    assert set(data) == set(MEASURES)
    for measure in MEASURES:
        assert len(data[measure]) == 3
        assert all(seconds > 0 for seconds in data[measure])
