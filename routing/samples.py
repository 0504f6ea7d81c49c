"""Recent samples of a quantity and their quantiles, kept sorted as they come.

Clocks learned from traffic (admission's think gaps, the KV-event feeds' lag behind the answers) read
a quantile on every request: re-sorting the window each time cost ~10 % of the proxy's CPU on small
requests (py-spy, issue 22). The sorted copy is kept up to date instead, one insertion and (once the
window is full) one removal per sample.

Invariants: the window holds the ``window`` most recent samples (>= 0; negative ones are ignored), and
the sorted copy holds exactly the same values.
"""

from __future__ import annotations

import bisect
from collections import deque

#: Samples remembered (the most recent): bounded memory, and the figure follows the current traffic.
DEFAULT_WINDOW = 1000
#: Fewer samples than this and the window says nothing yet.
MIN_SAMPLES = 20


class RecentSamples:
    """The most recent samples, in arrival order (the window) and in sorted order."""

    def __init__(self, window: int = DEFAULT_WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        if window < 1 or min_samples < 1:
            raise ValueError("window and min_samples must be >= 1")
        self._recent: deque[float] = deque(maxlen=window)
        self.min_samples = min_samples
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, value: float) -> None:
        if value >= 0:
            recent, ordered = self._recent, self._sorted
            if len(recent) == recent.maxlen:  # the oldest leaves the window
                del ordered[bisect.bisect_left(ordered, recent[0])]
            recent.append(value)
            bisect.insort(ordered, value)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (nearest rank) of the recent samples; None with fewer than ``min_samples``."""
        if len(self._recent) < self.min_samples:
            return None
        ordered = self._sorted
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
