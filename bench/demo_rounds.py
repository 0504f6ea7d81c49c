"""The rounds of one demo arm as one result: each figure the median of the rounds, with its spread
(min and max), and whether two arms' spreads overlap (their difference is then within noise).

One replay of a few dozen requests on simulated ranks moves from run to run (the admission
effect's hit rate read 55.0 %, 40.1 % and 47.3 % in three runs of one seed): a single figure
cannot say whether a difference is prefixgate's or the machine's."""

from __future__ import annotations

from statistics import median
from typing import Any

#: The figures a round reports that the demo compares: summary key -> name on screen.
FIGURES: dict[str, str] = {
    "hit_rate": "hit rate",
    "prefill_tokens": "prefill",
    "ttft_p50_ms": "TTFT p50",
    "ttft_p99_ms": "TTFT p99",
    "wall_s": "wall",
}
#: Counts never hidden by a median: the worst round's.
WORST = ("errors", "refused", "rejections")


def combine(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One arm's rounds (``run_arm`` summaries) as one summary: its ``FIGURES`` the medians, its
    ``WORST`` counts the highest, ``spread`` each figure's (min, max), ``rounds`` each round's
    figures, and the per-request lists (``turns``, ``ttft_s``) of the round nearest the median
    hit rate (what the plots draw)."""
    if not rounds:
        raise ValueError("no rounds to combine")
    middle = median(r["hit_rate"] for r in rounds)
    typical = min(rounds, key=lambda r: abs(r["hit_rate"] - middle))
    combined = dict(typical)
    for key in FIGURES:
        combined[key] = median(r[key] for r in rounds)
    for key in WORST:
        combined[key] = max(r[key] for r in rounds)
    failing = [r for r in rounds if r["errors"] > r["refused"]]
    combined["first_errors"] = failing[0]["first_errors"] if failing else []
    combined["spread"] = {key: (min(r[key] for r in rounds), max(r[key] for r in rounds)) for key in FIGURES}
    combined["rounds"] = [{key: r[key] for key in (*FIGURES, *WORST)} for r in rounds]
    combined["pooled_ttft_s"] = [t for r in rounds for t in r["ttft_s"]]
    return combined


def overlapping(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether two (min, max) spreads share a value."""
    return a[0] <= b[1] and b[0] <= a[1]
