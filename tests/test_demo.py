"""`prefixgate demo`, the README's first command, runs end to end and reports hits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_demo_runs_and_reports_cache_hits(tmp_path):
    result = subprocess.run(
        # one round (the default is 3, covered by tests/test_demo_effects.py): no spread to show
        [
            sys.executable,
            "-m",
            "proxy.cli",
            "demo",
            "--sessions",
            "4",
            "--turns",
            "3",
            "--ranks",
            "2",
            "--rounds",
            "1",
            "--out",
            str(tmp_path),  # its own demo.json: the two demo tests may run side by side
        ],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "round_robin" in result.stdout
    assert "in\none round" in result.stdout
    assert not any(line.startswith("    min-max") for line in result.stdout.splitlines())
    report = json.loads((tmp_path / "demo.json").read_text())
    for summary in report["results"].values():
        assert summary["requests"] == 12 and summary["errors"] == 0
        # later turns re-send earlier ones, so the ranks must report hits, never above the bound
        assert 0 < summary["hit_rate"] <= summary["bound"] + 1e-9
