"""`prefixgate demo` shows all three effects side by side in 80 columns (issue 21), each figure the
median of rounds with their min-max (issue 49), and says which differences are noise."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

from bench.demo import noise_line, spread_line
from bench.demo_effects import within_noise
from bench.demo_rounds import FIGURES, combine, overlapping

ROOT = Path(__file__).resolve().parents[1]
DEMO = (sys.executable, "-m", "proxy.cli", "demo")
LABELS = (
    "round_robin",
    "prefix_affinity",
    "canonicalization off",
    "canonicalization on",
    "admission off",
    "admission on",
)


def test_demo_shows_three_effects_in_80_columns(tmp_path):
    result = subprocess.run(
        [
            *DEMO,
            "--sessions",
            "4",
            "--turns",
            "3",
            "--ranks",
            "2",
            "--small-kv-tokens",
            "12000",
            "--rounds",
            "2",
            "--out",
            str(tmp_path),  # its own demo.json: the two demo tests may run side by side
        ],
        capture_output=True,
        text=True,
        timeout=300,
        # run from there: the demo names its output relative to the working directory, so the
        # line that names it fits in 80 columns however deep the temporary directory is
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    for number, title in ((1, "routing"), (2, "drifting agents"), (3, "more sessions than the pools")):
        assert any(line.startswith(f"{number}. {title}") for line in lines)
    for label in LABELS:  # one row per arm: hit rate and bound, prefill, TTFT p50 and p99
        (row,) = [line for line in lines if line.startswith(f"  {label} ")]
        assert row.count("%") == 2 and row.count("ms") == 2 and "k " in row, row
        # under it, the rounds' min-max of each figure but the bound
        spread = lines[lines.index(row) + 1]
        assert spread.startswith("    min-max ") and spread.count("%") == 1 and spread.count("ms") == 2, (
            spread
        )
    assert "prefill: prompt tokens the ranks had to compute" in result.stdout
    assert result.stderr == ""  # prefixgate's own log stays out of the table

    report = json.loads((tmp_path / "demo.json").read_text())
    effects = report["effects"]
    assert [list(e["arms"]) for e in effects] == [list(LABELS[i : i + 2]) for i in (0, 2, 4)]
    for effect in effects:
        for arm in effect["arms"].values():
            assert arm["errors"] == arm["refused"] == 0 and arm["requests"] > 0
            assert 0 < arm["hit_rate"] <= arm["bound"] + 1e-9
            assert len(arm["rounds"]) == 2  # --rounds 2: each replayed twice, the figure their median
            for key in FIGURES:
                low, high = arm["spread"][key]
                assert low <= arm[key] <= high
                assert sorted(r[key] for r in arm["rounds"]) == [low, high]
    drift = effects[1]["arms"]
    # a per-request hash in the system prompt: nothing past it can hit until canonicalization
    assert drift["canonicalization on"]["hit_rate"] > 2 * drift["canonicalization off"]["hit_rate"]
    assert effects[2]["arms"]["admission on"]["requests"] == 12 * 3


def test_within_noise_tells_a_shift_from_resampling():
    rng = random.Random(1)
    a = [rng.gauss(0.100, 0.010) for _ in range(200)]
    b = [rng.gauss(0.100, 0.010) for _ in range(200)]
    shifted = [x + 0.030 for x in b]
    inside, low, high = within_noise(a, b, 50)
    assert inside and low < 0 < high
    inside, low, high = within_noise(a, shifted, 50)
    assert not inside and 0.02 < low < high < 0.04
    # a single round: no spread to compare, the requests are resampled instead
    one = [{}]
    assert "p50" not in (noise_line({"ttft_s": a, "rounds": one}, {"ttft_s": shifted, "rounds": one}) or "")
    line = noise_line({"ttft_s": a, "rounds": one}, {"ttft_s": b, "rounds": one})
    assert (
        line is not None and line.startswith("  ~ TTFT difference within noise (95%): p50 ") and "p50" in line
    )


def round_summary(hit_rate: float, ttft_p50_ms: float, errors: int = 0) -> dict[str, object]:
    return {
        "hit_rate": hit_rate,
        "prefill_tokens": 1000 * (1 - hit_rate),
        "ttft_p50_ms": ttft_p50_ms,
        "ttft_p99_ms": 3 * ttft_p50_ms,
        "wall_s": ttft_p50_ms / 100,
        "errors": errors,
        "refused": 0,
        "rejections": 0,
        "first_errors": ["boom"] if errors else [],
        "ttft_s": [ttft_p50_ms / 1000],
        "turns": [{"hit_rate": hit_rate}],
    }


def test_rounds_combine_into_medians_with_their_spread_and_the_worst_errors():
    arm = combine([round_summary(0.55, 200), round_summary(0.401, 150, errors=2), round_summary(0.473, 400)])
    assert arm["hit_rate"] == 0.473 and arm["ttft_p50_ms"] == 200  # medians, figure by figure
    assert arm["spread"]["hit_rate"] == (0.401, 0.55) and arm["spread"]["ttft_p50_ms"] == (150, 400)
    assert arm["errors"] == 2 and arm["first_errors"] == ["boom"]  # a median would hide the bad round
    assert arm["turns"] == [{"hit_rate": 0.473}]  # the plots draw the round nearest the median
    assert len(arm["rounds"]) == 3 and arm["pooled_ttft_s"] == [0.2, 0.15, 0.4]
    assert overlapping((1, 3), (3, 4)) and overlapping((1, 5), (2, 3)) and not overlapping((1, 2), (2.5, 4))


def test_overlapping_spreads_are_flagged_as_noise_and_separate_ones_are_not():
    # the admission line of issue 49: 55.0 %, 40.1 %, 47.3 % without; say 45-60 % with
    without = combine([round_summary(0.55, 200), round_summary(0.401, 210), round_summary(0.473, 190)])
    with_ = combine([round_summary(0.45, 100), round_summary(0.60, 110), round_summary(0.52, 105)])
    line = noise_line(without, with_)
    assert line is not None and line.startswith("  ~ within noise (min-max overlap): hit rate")
    assert "TTFT" not in line  # 190-210 ms against 100-110 ms: a real difference
    apart = combine([round_summary(0.80, 100), round_summary(0.82, 110), round_summary(0.81, 105)])
    line = noise_line(without, apart) or ""
    assert "hit rate" not in line and "TTFT" not in line


def test_the_spread_line_puts_each_range_under_its_column():
    arm = combine([round_summary(0.55, 200), round_summary(0.401, 150), round_summary(0.473, 400)])
    line = spread_line(arm)
    assert line is not None and len(line) <= 80
    header = __import__("bench.demo", fromlist=["HEADER"]).HEADER
    assert line.index("40.1-55.0%") + len("40.1-55.0%") == header.index("hit rate") + len("hit rate")
    assert "150-400ms" in line and "450-1200ms" in line and "1.5-4.0s" in line
    assert spread_line(combine([round_summary(0.5, 100)])) is None  # one round: no spread to show
