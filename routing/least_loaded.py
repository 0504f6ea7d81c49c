"""Least loaded: the rank with the fewest requests in flight, then the least prefill queued."""

from __future__ import annotations

from collections.abc import Sequence

from routing.policy import RouteRequest
from routing.ranks import Rank


class LeastLoaded:
    name = "least_loaded"
    uses_blocks = True  # needs the prompt's blocks (or at least its token count)

    def __init__(self) -> None:
        self._turn = 0  # rotates ties, so an idle fleet is not all sent to the first rank

    def choose(self, request: RouteRequest, candidates: Sequence[Rank]) -> Rank:
        queued = request.queued_prefill
        n = len(candidates)
        start = self._turn % n
        self._turn += 1
        best = candidates[start]
        best_key = (best.in_flight, queued.get(best.name, 0))
        for k in range(1, n):
            b = candidates[(start + k) % n]
            key = (b.in_flight, queued.get(b.name, 0))
            if key < best_key:
                best, best_key = b, key
        return best
