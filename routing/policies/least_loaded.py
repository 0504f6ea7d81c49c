"""Least loaded: the rank with the fewest requests in flight, then the least prefill queued.

Ties rotate, so an idle fleet is not all sent to the first rank; the order after the first is by
the same load.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from routing.policies.protocol import Needs, PolicyOptions, RouteRequest
from routing.ranks import Rank


class LeastLoaded:
    name: ClassVar[str] = "least_loaded"
    needs: ClassVar[Needs] = Needs(blocks=True)  # queued prefill needs the prompt's size

    def __init__(self) -> None:
        self._turn = 0

    @classmethod
    def from_options(cls, options: PolicyOptions) -> LeastLoaded:
        return cls()

    def order(self, request: RouteRequest, candidates: Sequence[Rank]) -> list[Rank]:
        queued = request.queued_prefill
        n = len(candidates)
        start = self._turn % n
        self._turn += 1
        rotation = [candidates[(start + k) % n] for k in range(n)]
        return sorted(rotation, key=lambda r: (r.in_flight, queued.get(r.name, 0)))
