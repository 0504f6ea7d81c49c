"""bench/miss_breakdown.py: each request's loss against the bound goes to one cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.miss_breakdown import breakdown, main, read_log

LOG = """\
2026-11-30 08:59:04,174 INFO prefixgate.route: session b turn 1 moved r0 -> r1: saturated (in flight r0=3)
2026-11-30 08:59:05,000 INFO prefixgate.admission: session c released before its turn 1 on r0 after 0.3 s idle
2026-11-30 08:59:06,000 INFO prefixgate.route: session c turn 1 moved r0 -> r1: admitted anew (back)
2026-11-30 08:59:07,000 INFO prefixgate.route: session d turn 1 moved r0 -> r1: over the load bound (r0=4)
"""


def turn(
    session: str, index: int, backend: str, cached: int, bound: int, prompt: int = 1000
) -> dict[str, object]:
    return {
        "session": session,
        "turn": index,
        "backend": backend,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "bound_hit_tokens": bound,
    }


TURNS = [
    turn("a", 0, "r0", 0, 300),
    turn("a", 1, "r0", 900, 900),  # hit as the bound
    turn("a", 2, "r0", 500, 900),  # evicted on its own rank
    turn("b", 0, "r0", 300, 300),
    turn("b", 1, "r1", 300, 900),  # moved: saturated
    turn("c", 0, "r0", 300, 300),
    turn("c", 1, "r1", 0, 900),  # released, then placed elsewhere
    turn("d", 0, "r0", 300, 300),
    turn("d", 1, "r1", 100, 900),  # moved by the load bound
]


def test_each_loss_is_charged_to_its_cause(tmp_path: Path) -> None:
    log = tmp_path / "proxy.log"
    log.write_text(LOG)
    result = breakdown(TURNS, read_log(log)).to_dict()
    causes = {name: (c["requests"], c["lost_tokens"]) for name, c in result["causes"].items()}
    assert causes == {
        "first turn": (4, 300),
        "same rank, hit as the bound": (1, 0),
        "same rank, evicted": (1, 400),
        "moved: saturated": (1, 600),
        "moved: admitted anew after a release": (1, 900),
        "moved: over the load bound": (1, 800),
    }
    assert result["lost_tokens"] == result["bound_hit_tokens"] - result["cached_tokens"] == 3000


def test_without_a_log_moves_are_unexplained_and_the_report_is_written(tmp_path: Path) -> None:
    results = tmp_path / "results.json"
    report = {"scenarios": {"over": {"results": {"prefixgate prefix_affinity": {"turns": TURNS}}}}}
    results.write_text(json.dumps(report))
    out = tmp_path / "breakdown.json"
    assert main([str(results), "--out", str(out)]) == 0
    written = json.loads(out.read_text())
    assert written["causes"]["moved: unknown (no log)"] == {"requests": 3, "lost_tokens": 2300}


def test_a_system_run_with_extra_flags_is_found_by_its_policy_and_a_wrong_name_lists_the_systems(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results.json"
    named = "prefixgate prefix_affinity --log-level info"  # prefixgate:prefix_affinity:--log-level info
    report = {
        "scenarios": {"over": {"results": {named: {"turns": TURNS}, "sglang cache_aware": {"turns": []}}}}
    }
    results.write_text(json.dumps(report))
    out = tmp_path / "breakdown.json"
    assert main([str(results), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["system"] == named
    with pytest.raises(SystemExit):
        main([str(results), "--system", "vllm-router", "--out", str(out)])
    assert "'sglang cache_aware'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(results), "--scenario", "fits", "--out", str(out)])
    assert "the results hold 'over'" in capsys.readouterr().err
