"""Per-request latency histograms of a simulated rank, as vLLM exports them (``/metrics``).

vLLM records, for each finished stage of a request: the time it waited in the scheduler's queue
(``vllm:request_queue_time_seconds``, arrival to first scheduled), the time it spent in prefill
(``vllm:request_prefill_time_seconds``, first scheduled to first token), the time to first token
(``vllm:time_to_first_token_seconds``) and the whole request (``vllm:e2e_request_latency_seconds``).
Times are wall-clock seconds as the rank lived them (the modelled durations x ``time_scale``), so a
client of a compressed rank learns its compressed speed.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

#: vLLM's request-latency buckets, thinned (seconds).
BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.08,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)

#: The histograms, by the short name ``RequestLatencies`` records them under, and their vLLM name.
NAMES: dict[str, tuple[str, str]] = {
    "queue": ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request."),
    "prefill": ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request."),
    "ttft": ("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    "e2e": ("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
}


@dataclass(slots=True)
class Histogram:
    """Cumulative bucket counts (one more for +Inf), sum and count, like a Prometheus histogram."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    sum: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds

    @property
    def count(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        """``(le, cumulative count)`` pairs, the last one ``+Inf``."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*(str(b) for b in BUCKETS), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out


@dataclass(slots=True)
class RequestLatencies:
    """The four request histograms of one rank."""

    histograms: dict[str, Histogram] = field(default_factory=lambda: {k: Histogram() for k in NAMES})

    def first_token(self, arrival: float, scheduled: float, now: float) -> None:
        """A request's first token: its queue, prefill and first-token times are known."""
        h = self.histograms
        h["queue"].observe(max(scheduled - arrival, 0.0))
        h["prefill"].observe(max(now - scheduled, 0.0))
        h["ttft"].observe(max(now - arrival, 0.0))

    def finished(self, arrival: float, now: float) -> None:
        self.histograms["e2e"].observe(max(now - arrival, 0.0))
