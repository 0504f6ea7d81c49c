"""Several rounds of one ``prefixgate bench`` scenario, read as one: the median of each figure.

One run of a scenario is noisy on a shared machine, and so is a peer's placement: the same
``vllm-router consistent_hash`` hit 0.68 in one run and 0.84 in the next on the ``matrix`` preset's
``over`` cell (its hash of the run's session ids decides which sessions share a rank). With
``--rounds N`` every system runs N times, each round in a rotated order (``rotation``) so that no
system always runs first or last, and its summary is the median of its rounds, figure by figure
(``combine``); errors and 429s are the worst round's. A figure's median comes from its own column:
the median hit rate and the median p99 may come from different rounds. Each round's figures stay
in the summary (``rounds``), and the turns (the plots' input) are those of the round whose hit
rate is the median.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any, TypeVar

_T = TypeVar("_T")

#: Summary entries that are not figures: carried from the median round, never combined.
_CARRIED = ("turns", "rank_counters", "first_errors", "rounds")
#: Failures, reported from the worst round: a median would hide a round that lost requests.
_WORST = ("errors", "rejections", "rate_limited", "refused")


def rotation(systems: Sequence[_T], round_index: int) -> list[_T]:
    """The systems in round ``round_index``'s order: the list rotated by the round's index."""
    if not systems:
        return []
    shift = round_index % len(systems)
    return [*systems[shift:], *systems[:shift]]


def combine(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One system's summary over its rounds: each numeric figure the median of the rounds that
    finished (errors, 429s and refusals: the most of any round); ``failed`` when none did.
    ``rounds`` lists every round's figures (without its turns), in order, failed ones as
    ``{"failed": why}``."""
    if not rounds:
        raise ValueError("no rounds to combine")
    done = [r for r in rounds if "failed" not in r]
    kept = [{k: v for k, v in r.items() if k not in _CARRIED} for r in rounds]
    if not done:
        return {"failed": "; ".join(str(r["failed"]) for r in rounds), "rounds": kept}
    middle = sorted(done, key=lambda r: r.get("hit_rate", 0.0))[len(done) // 2]
    out: dict[str, Any] = dict(middle)
    for key, value in middle.items():
        if key in _CARRIED or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        values = [r[key] for r in done if isinstance(r.get(key), int | float)]
        if key in _WORST:
            out[key] = max(values)
            continue
        median = statistics.median(values)
        out[key] = type(value)(median) if isinstance(value, int) and median == int(median) else median
    out["rounds"] = kept
    return out


def combine_all(rounds: Sequence[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Every system's combined summary (``combine``), in the first round's order of systems."""
    names = list(dict.fromkeys(name for results in rounds for name in results))
    return {name: combine([r[name] for r in rounds if name in r]) for name in names}
