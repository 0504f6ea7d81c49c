"""``python -m bench.proxy_cpu``: each proxy's CPU per request, by the shape of the turn."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.common import OUT_DIR


def test_proxy_cpu_reports_each_system_and_workload() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bench.proxy_cpu", "--rounds", "1", "--turns", "3", "--chunks", "5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((OUT_DIR / "proxy_cpu.json").read_text())
    assert set(report["systems"]) == {"prefixgate", "plain"}
    assert report["chunks"] == 5
    for system in report["systems"].values():
        assert set(system) == {"small", "repeat_100k", "growing", "first_turns"}
        assert all(case["median_ms"] > 0 for case in system.values())
    # a first turn's whole 100k-token prompt is tokenized: more work than a repeated turn, which
    # prefixgate recognizes as unchanged (plain tokenizes neither)
    prefixgate = report["systems"]["prefixgate"]
    assert prefixgate["first_turns"]["median_ms"] > prefixgate["repeat_100k"]["median_ms"]
