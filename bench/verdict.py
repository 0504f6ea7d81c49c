"""Whether prefixgate is ahead of every peer, and whether it met issue 17's targets, in one scenario.

Read from the per-system summaries of one run (the same trace, ranks and speed for every system):

- per measure (hit rate and prefill, TTFT p50/p99, mean turn latency, completion time, 429s, errors)
  whether prefixgate's default system did better than every peer, or as well;
- the targets: no errors; a hit rate at least the best peer's + 0.15 once the working set exceeds
  the pools, within 0.01 of the infinite-cache bound while sessions fit; TTFT p99 at most 1.25x the
  best peer's; completion time at most the best peer's; the p99 wait for a seat within the rotation
  bound (at most 1 % of requests seated past it and one poll interval, as prefixgate counts them).
"""

from __future__ import annotations

from typing import Any

#: The system the targets are about: prefixgate with its default policy and default settings.
PREFIXGATE = "prefixgate prefix_affinity"
#: Mean working set over the pools below which sessions count as fitting (besides a scenario named so).
FITS_BELOW = 0.8
HIT_MARGIN_OVER = 0.15
HIT_GAP_FITS = 0.01
TTFT_P99_FACTOR = 1.25
#: Issue 45: the p99 wait for a seat within the rotation bound, so at most 1 % of requests past it.
SEAT_WAIT_QUANTILE_OVER = 0.01

#: (measure, its key in the summary, higher is better)
MEASURES: tuple[tuple[str, str, bool], ...] = (
    ("hit rate", "hit_rate", True),
    ("prefill", "prefill_tokens", False),
    ("TTFT p50", "ttft_p50_ms", False),
    ("TTFT p99", "ttft_p99_ms", False),
    ("mean turn latency", "latency_mean_ms", False),
    ("completion", "wall_s", False),
    ("429s", "rejections", False),
    ("errors", "errors", False),
)


def _is_peer(name: str) -> bool:
    return name.startswith(("sglang", "vllm-router"))


def verdict(scenario: str, results: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The comparison and the targets for ``scenario`` (None without prefixgate or peers)."""
    ours = results.get(PREFIXGATE)
    peers = {n: r for n, r in results.items() if _is_peer(n) and "failed" not in r}
    if ours is None or "failed" in ours or not peers:
        return None
    ahead = {}
    for label, key, higher in MEASURES:
        values = [r[key] for r in peers.values()]
        best = max(values) if higher else min(values)
        ahead[label] = {
            "prefixgate": ours[key],
            "best_peer": best,
            "ahead": ours[key] > best if higher else ours[key] < best,
            "level": ours[key] == best,
        }
    best_hit = max(r["hit_rate"] for r in peers.values())
    best_p99 = min(r["ttft_p99_ms"] for r in peers.values())
    best_wall = min(r["wall_s"] for r in peers.values())
    fits = scenario.split("-")[-1] == "fits" or ours["working_set_mean_x_pools"] < FITS_BELOW
    if fits:
        hit_target = {
            "target": f">= bound {ours['bound']:.3f} - {HIT_GAP_FITS}",
            "met": ours["hit_rate"] >= ours["bound"] - HIT_GAP_FITS,
        }
    else:
        hit_target = {
            "target": f">= best peer {best_hit:.3f} + {HIT_MARGIN_OVER}",
            "met": ours["hit_rate"] >= best_hit + HIT_MARGIN_OVER,
        }
    hit_target["measured"] = ours["hit_rate"]
    targets = {
        "errors": {"target": "0", "measured": ours["errors"], "met": ours["errors"] == 0},
        "hit rate": hit_target,
        "TTFT p99": {
            "target": f"<= {TTFT_P99_FACTOR} x best peer {best_p99:.0f} ms",
            "measured": ours["ttft_p99_ms"],
            "met": ours["ttft_p99_ms"] <= TTFT_P99_FACTOR * best_p99,
        },
        "completion": {
            "target": f"<= best peer {best_wall:.1f} s",
            "measured": ours["wall_s"],
            "met": ours["wall_s"] <= best_wall,
        },
    }
    late = ours.get("seat_waits_past_bound")
    if late is not None:  # p99 within the bound: at most 1 % of requests seated past it
        allowed = SEAT_WAIT_QUANTILE_OVER * ours["requests"]
        targets["seat wait p99"] = {
            "target": f"within the rotation bound: <= {allowed:.0f} seated past it",
            "measured": late,
            "met": late <= allowed,
        }
    return {"fits": fits, "ahead": ahead, "targets": targets}


def verdict_lines(found: dict[str, Any]) -> list[str]:
    """The verdict as the terminal and the docs print it."""
    ahead = found["ahead"]
    marks = ", ".join(
        f"{label} {'ahead' if v['ahead'] else 'level' if v['level'] else 'behind'}"
        for label, v in ahead.items()
    )
    lines = [f"{PREFIXGATE} against every peer: {marks}"]
    for label, t in found["targets"].items():
        lines.append(f"target {label} {t['target']}: {_fmt(t['measured'])} {'met' if t['met'] else 'MISSED'}")
    return lines


def _fmt(value: float) -> str:
    return f"{value:.3f}" if isinstance(value, float) and value < 10 else f"{value:.0f}"
