"""`prefixgate demo` shows all three effects side by side in 80 columns (issue 21), and says when a
latency difference is noise."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

from bench.demo import noise_line
from bench.demo_effects import within_noise

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


def test_demo_shows_three_effects_in_80_columns():
    result = subprocess.run(
        [*DEMO, "--sessions", "4", "--turns", "3", "--ranks", "2", "--small-kv-tokens", "12000"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80, max(lines, key=len)
    for number, title in ((1, "routing"), (2, "drifting agents"), (3, "more sessions than the pools")):
        assert any(line.startswith(f"{number}. {title}") for line in lines)
    for label in LABELS:  # one row per replay: hit rate and bound, prefill, TTFT p50 and p99
        (row,) = [line for line in lines if line.startswith(f"  {label} ")]
        assert row.count("%") == 2 and row.count("ms") == 2 and "k " in row, row
    assert "prefill: prompt tokens the ranks had to compute" in result.stdout
    assert result.stderr == ""  # prefixgate's own log stays out of the table

    report = json.loads((ROOT / "bench" / "out" / "demo.json").read_text())
    effects = report["effects"]
    assert [list(e["arms"]) for e in effects] == [list(LABELS[i : i + 2]) for i in (0, 2, 4)]
    for effect in effects:
        for arm in effect["arms"].values():
            assert arm["errors"] == arm["refused"] == 0 and arm["requests"] > 0
            assert 0 < arm["hit_rate"] <= arm["bound"] + 1e-9
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
    assert "p50" not in (noise_line({"ttft_s": a}, {"ttft_s": shifted}) or "")
    line = noise_line({"ttft_s": a}, {"ttft_s": b})
    assert (
        line is not None and line.startswith("  ~ TTFT difference within noise (95%): p50 ") and "p50" in line
    )
