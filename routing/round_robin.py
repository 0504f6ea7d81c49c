"""Round robin over the healthy ranks: the baseline every other policy is measured against."""

from __future__ import annotations

from collections.abc import Sequence

from routing.policy import RouteRequest
from routing.ranks import Rank


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: RouteRequest, candidates: Sequence[Rank]) -> Rank:
        backend = candidates[self._next % len(candidates)]
        self._next += 1
        return backend
