"""Think gaps across sessions: how long agents usually stay quiet between an answer and their next request.

Admission judges a session ended once it has been quiet for longer than ``release_factor`` x its own
longest think gap. A session with fewer than ``OWN_EVIDENCE`` gaps says little about itself (a single
short gap, or none at all for a one-request session), so there the population's gaps stand in: the
``quantile`` of recent gaps of every session, a typical agent's long pause.
"""

from __future__ import annotations

import bisect
from collections import deque

#: Gaps remembered (the most recent): bounded memory, and the figure follows the current traffic.
DEFAULT_WINDOW = 1000
#: Fewer gaps than this and the population says nothing yet.
MIN_SAMPLES = 20
#: A session with at least this many gaps of its own is judged by them alone.
OWN_EVIDENCE = 3


class ThinkGaps:
    """Recent think gaps of all sessions, kept in arrival order (the window) and in sorted order.

    Every returning turn adds a gap and admission reads a quantile on every request: re-sorting the
    window each time cost ~10 % of the proxy's CPU on small requests (py-spy, issue 22). The sorted
    copy is kept up to date instead, one insertion and (once the window is full) one removal per gap.
    """

    def __init__(self, window: int = DEFAULT_WINDOW, min_samples: int = MIN_SAMPLES) -> None:
        if window < 1 or min_samples < 1:
            raise ValueError("window and min_samples must be >= 1")
        self._recent: deque[float] = deque(maxlen=window)
        self.min_samples = min_samples
        self._sorted: list[float] = []

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, gap_s: float) -> None:
        if gap_s >= 0:
            recent, ordered = self._recent, self._sorted
            if len(recent) == recent.maxlen:  # the oldest leaves the window
                del ordered[bisect.bisect_left(ordered, recent[0])]
            recent.append(gap_s)
            bisect.insort(ordered, gap_s)

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (nearest rank) of the recent gaps; None with fewer than ``min_samples``."""
        if len(self._recent) < self.min_samples:
            return None
        ordered = self._sorted
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def longer_than(self, seconds: float) -> float | None:
        """The share of recent gaps longer than ``seconds`` (None with fewer than ``min_samples``)."""
        if len(self._recent) < self.min_samples:
            return None
        ordered = self._sorted
        return (len(ordered) - bisect.bisect_right(ordered, seconds)) / len(ordered)
