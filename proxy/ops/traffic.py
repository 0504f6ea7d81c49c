"""What the process answered lately, for the dashboard and ``prefixgate top``: request rate, time to
first byte, errors and 429s.

The pipeline adds one entry per answered request (a tuple on a bounded deque and a few counters: no
cost worth a sample rate); the readers compute percentiles and rates from a copy, changing nothing.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from proxy.errors import CLIENT_CLOSED

#: Answers kept for the percentiles and the rate (the hit rate's window is as long).
RECENT = 1000
#: The request rate is over this many seconds (or since start, when the process is younger).
RATE_SPAN_S = 60.0


@dataclass(frozen=True, slots=True)
class Answer:
    time: float
    status: int
    #: Seconds from the request's arrival to its first byte, for a successful completion; else None.
    first_byte_s: float | None
    #: A stream that broke after its 200 (ended with an SSE error event).
    broken: bool = False

    @property
    def error(self) -> bool:
        return self.broken or (self.status >= 500 and self.status != CLIENT_CLOSED)


def nearest_rank(ordered: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of sorted values by nearest rank; None when there are none."""
    if not ordered:
        return None
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class Traffic:
    """The last ``size`` answers and the totals since start."""

    def __init__(self, size: int = RECENT, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.started = clock()
        self.recent: deque[Answer] = deque(maxlen=size)
        self.total = 0
        self.errors = 0
        self.rate_limited = 0
        self.client_closed = 0

    def add(self, status: int, first_byte_s: float | None = None, *, broken: bool = False) -> None:
        answer = Answer(self.clock(), status, first_byte_s, broken)
        self.recent.append(answer)
        self.total += 1
        if answer.error:
            self.errors += 1
        elif status == 429:
            self.rate_limited += 1
        elif status == CLIENT_CLOSED:
            self.client_closed += 1

    def summary(self, now: float | None = None) -> dict[str, Any]:
        """Rate over the last minute, first-byte percentiles, errors and 429s (recent and total)."""
        now = self.clock() if now is None else now
        recent = list(self.recent)
        since = now - RATE_SPAN_S
        last_minute = sum(1 for a in recent if a.time >= since)
        if recent and len(recent) == self.recent.maxlen and recent[0].time >= since:
            rate = len(recent) / max(now - recent[0].time, 1e-3)  # more than the window in a minute
        else:
            rate = last_minute / max(min(RATE_SPAN_S, now - self.started), 1e-3)
        first_bytes = sorted(a.first_byte_s for a in recent if a.first_byte_s is not None)
        p50, p99 = nearest_rank(first_bytes, 0.5), nearest_rank(first_bytes, 0.99)
        return {
            "requests_per_s": rate,
            "rate_span_s": RATE_SPAN_S,
            "window": {
                "requests": len(recent),
                "size": self.recent.maxlen,
                "ttfb_p50_ms": None if p50 is None else p50 * 1000,
                "ttfb_p99_ms": None if p99 is None else p99 * 1000,
                "ttfb_requests": len(first_bytes),
                "errors": sum(1 for a in recent if a.error),
                "rate_limited": sum(1 for a in recent if a.status == 429 and not a.error),
            },
            "total": {
                "requests": self.total,
                "errors": self.errors,
                "rate_limited": self.rate_limited,
                "client_closed": self.client_closed,
            },
        }
