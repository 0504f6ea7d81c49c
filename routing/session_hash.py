"""Consistent hashing with bounded loads (CHWBL) on the session key.

Each rank owns ``vnodes`` points of a 64-bit ring; a session goes to the first rank clockwise from
its key's hash whose in-flight requests stay within ``balance_factor`` x the fleet mean. A rank
joining or leaving moves only the sessions on its arcs; every replica computes the same ring.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import xxhash

from routing.policy import DEFAULT_BALANCE_FACTOR, RouteRequest, load_bound, within_bound
from routing.ranks import Rank


class SessionHash:
    name = "session_hash"

    def __init__(self, balance_factor: float = DEFAULT_BALANCE_FACTOR, vnodes: int = 64) -> None:
        self.balance_factor = balance_factor
        self.vnodes = vnodes
        self._ring_for: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []
        self._anonymous = 0

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

    def choose(self, request: RouteRequest, candidates: Sequence[Rank]) -> Rank:
        bound = load_bound(candidates, self.balance_factor)
        key = request.session_key
        if key is None:
            # Without a session there is nothing to be sticky to: spread by load.
            self._anonymous += 1
            n = len(candidates)
            return min((candidates[(self._anonymous + k) % n] for k in range(n)), key=lambda b: b.in_flight)
        by_name = {b.name: b for b in candidates}
        # The ring covers every candidate; it is rebuilt only when the healthy set changes.
        self._ring(tuple(sorted(by_name)))
        points, owners = self._points, self._owners
        start = bisect.bisect(points, xxhash.xxh3_64_intdigest(key.encode()))
        seen: set[str] = set()
        for k in range(len(points)):
            name = owners[(start + k) % len(points)]
            if name in seen:
                continue
            seen.add(name)
            backend = by_name[name]
            if within_bound(backend, bound):
                return backend
            if len(seen) == len(by_name):
                break
        return min(candidates, key=lambda b: b.in_flight)
