"""``python -m bench.paced_load``: sessions paced below saturation, direct and through prefixgate,
with large first turns arriving, and the proxy's event-loop lag read around each phase."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.common import OUT_DIR


def test_paced_load_paces_its_sessions_and_reports_the_loop_lag() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.paced_load",
            "--rates",
            "40",
            "--sessions",
            "8",
            "--seconds",
            "3",
            "--first-turn-tokens",
            "3000",
            "--first-turn-every",
            "0.5",
            "--idle-seconds",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads((OUT_DIR / "paced_load.json").read_text())
    (row,) = report["rates"]
    direct, proxied = row["direct"], row["prefixgate"]
    assert direct["errors"] == proxied["errors"] == 0
    assert direct["completed"] > 0 and proxied["completed"] > 0
    # paced: 8 sessions thinking 0.2 s on average between turns, not a closed loop (hundreds a second)
    assert row["prefixgate"]["think_s"] == 0.2
    assert proxied["requests_per_s"] < 3 * 40
    assert proxied["first_turns"] >= 1  # the large first turns went through prefixgate only
    assert "first_turns" not in direct
    assert proxied["loop_lag"]["samples"] > 0
    assert 0 < proxied["proxy_core_share"] < 2
    # with no traffic the proxy's own timers and checks use a sliver of a core, not nothing and not a core
    assert 0 < report["idle_core_share"] < 0.5
