"""Round robin over the healthy ranks: the baseline every other policy is measured against.

The order is the rotation from this request's turn; the turn advances once per routed request.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from routing.policies.protocol import Needs, PolicyOptions, RouteRequest
from routing.ranks import Rank


class RoundRobin:
    name: ClassVar[str] = "round_robin"
    needs: ClassVar[Needs] = Needs()

    def __init__(self) -> None:
        self._next = 0

    @classmethod
    def from_options(cls, options: PolicyOptions) -> RoundRobin:
        return cls()

    def order(self, request: RouteRequest, candidates: Sequence[Rank]) -> list[Rank]:
        start = self._next % len(candidates)
        self._next += 1
        return [*candidates[start:], *candidates[:start]]
