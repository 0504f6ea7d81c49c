"""A prefixgate process's event-loop lag over a benchmark phase, from its own histogram
(``prefixgate_event_loop_lag_seconds``, ``proxy/loop_lag.py``) read before and after the phase."""

from __future__ import annotations

import httpx

from proxy.loop_lag import NAME

Buckets = dict[float, float]  # upper bound (seconds) -> cumulative count


def scrape(url: str) -> Buckets:
    """The histogram's cumulative bucket counts at ``url`` (a prefixgate base URL)."""
    text = httpx.get(url + "/metrics", timeout=10.0, trust_env=False).text
    out: Buckets = {}
    prefix = NAME + '_bucket{le="'
    for line in text.splitlines():
        if line.startswith(prefix):
            bound, _, count = line[len(prefix) :].partition('"} ')
            out[float("inf") if bound == "+Inf" else float(bound)] = float(count)
    return out


def summary(before: Buckets, after: Buckets) -> dict[str, float | None]:
    """Samples between the two scrapes and their p50, p99 and max as bucket upper bounds (ms)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    out: dict[str, float | None] = {"samples": total}
    for name, q in (("p50_ms_at_most", 0.5), ("p99_ms_at_most", 0.99), ("max_ms_at_most", 1.0)):
        bound = next((b for b, c in zip(bounds, counts, strict=True) if total and c >= q * total), None)
        out[name] = None if bound is None or bound == float("inf") else round(bound * 1000, 2)
    return out
