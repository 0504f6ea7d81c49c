"""Consistent hashing with bounded loads (CHWBL) on the session key.

Each rank owns ``vnodes`` points of a 64-bit ring; a session goes to the first rank clockwise from
its key's hash whose in-flight requests stay within ``balance_factor`` x the fleet mean. A rank
joining or leaving moves only the sessions on its arcs; every replica computes the same ring.

The order after the first: the next ranks clockwise within the bound, then the ranks over it, least
loaded first. Requests without a session key are spread by load, rotating ties.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import ClassVar

import xxhash

from routing.policies.bounds import DEFAULT_BALANCE_FACTOR, load_bound, within_bound
from routing.policies.protocol import Needs, PolicyOptions, RouteRequest
from routing.ranks import Rank


class SessionHash:
    name: ClassVar[str] = "session_hash"
    needs: ClassVar[Needs] = Needs()

    def __init__(self, balance_factor: float = DEFAULT_BALANCE_FACTOR, vnodes: int = 64) -> None:
        self.balance_factor = balance_factor
        self.vnodes = vnodes
        self._ring_for: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []
        self._anonymous = 0

    @classmethod
    def from_options(cls, options: PolicyOptions) -> SessionHash:
        return cls(balance_factor=options.balance_factor)

    def _ring(self, names: tuple[str, ...]) -> None:
        if names == self._ring_for:
            return
        points = sorted(
            (xxhash.xxh3_64_intdigest(f"{name}#{v}".encode()), name)
            for name in names
            for v in range(self.vnodes)
        )
        self._points = [p for p, _ in points]
        self._owners = [n for _, n in points]
        self._ring_for = names

    def order(self, request: RouteRequest, candidates: Sequence[Rank]) -> list[Rank]:
        key = request.session_key
        if key is None:
            # Without a session there is nothing to be sticky to: spread by load.
            self._anonymous += 1
            n = len(candidates)
            rotation = [candidates[(self._anonymous + k) % n] for k in range(n)]
            return sorted(rotation, key=lambda r: r.in_flight)
        bound = load_bound(candidates, self.balance_factor)
        by_name = {r.name: r for r in candidates}
        # The ring covers every candidate; it is rebuilt only when the healthy set changes.
        self._ring(tuple(sorted(by_name)))
        points, owners = self._points, self._owners
        start = bisect.bisect(points, xxhash.xxh3_64_intdigest(key.encode()))
        clockwise: list[Rank] = []
        seen: set[str] = set()
        for k in range(len(points)):
            name = owners[(start + k) % len(points)]
            if name in seen:
                continue
            seen.add(name)
            rank = by_name[name]
            if within_bound(rank, bound):
                clockwise.append(rank)
            if len(seen) == len(by_name):
                break
        over = sorted((r for r in candidates if not within_bound(r, bound)), key=lambda r: r.in_flight)
        return clockwise + over
