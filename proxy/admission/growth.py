"""How large sessions grow before they end, learned from the sessions that ended.

An agent session's context grows turn after turn (a Claude Code conversation from its ~15k-token
system prompt and tools to tens of thousands of tokens), so the room a session needs on its rank is
not its prompt at admission but what it will hold by its last turn. Admission reserves, per active
session, the expected peak of a session that already holds ``c`` tokens: the mean of the peaks of
recently ended sessions that reached at least ``c`` (a session never shrinks, so only those are
comparable). With no such session on record it reserves ``c`` itself: no growth is assumed until
some has been seen (admission re-homes a session when a rank outgrows its pool anyway), and a
session larger than any seen so far is reserved as large as it is.
"""

from __future__ import annotations

import bisect
from collections import deque

#: Ended sessions remembered (the most recent): a bound on memory, and the estimate follows the
#: current traffic rather than all of history.
DEFAULT_WINDOW = 1000


class PeakEstimator:
    """Peak context tokens of recently ended sessions, and the expected peak given a current size."""

    def __init__(self, window: int = DEFAULT_WINDOW) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: list[int] = []
        #: ``_above[i]`` = sum of ``_sorted[i:]``; one more entry (0) past the end.
        self._above: list[int] = [0]

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, peak_tokens: int) -> None:
        """Record the largest context an ended session held (sessions end far less often than
        admission asks, so the sums are rebuilt here rather than per query)."""
        recent = self._recent
        if len(recent) == recent.maxlen:
            old = recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        recent.append(peak_tokens)
        bisect.insort(self._sorted, peak_tokens)
        above = [0] * (len(self._sorted) + 1)
        for i in range(len(self._sorted) - 1, -1, -1):
            above[i] = above[i + 1] + self._sorted[i]
        self._above = above

    def expected_peak(self, tokens: int) -> int:
        """The mean peak of the recorded sessions that reached ``tokens``; ``tokens`` when none did."""
        first = bisect.bisect_left(self._sorted, tokens)
        count = len(self._sorted) - first
        if count == 0:
            return tokens
        return max(tokens, -(-self._above[first] // count))
