"""Admission's claims on room: what decides whether a rank has room, where every replica sees it.

Admission (``proxy/admission/``) decides on its own count of the session table; a ``RoomClaims``
makes the decision's step that takes room authoritative. ``reserve`` checks each allowed rank's
claimed tokens against its budget and reserves in one atomic step, returning the ranks granted;
``claim`` turns the reservation into the session's claim on the rank it went to (and keeps it
current as the session grows); ``release`` ends it. A claim's tokens are its projected working set:
its own ``body`` plus a shared ``head`` (an agent's system+tools) counted once per rank.

``LocalClaims`` (the ``memory`` backend) grants what one process's own count allowed: there, that
count is the whole truth. ``redis_claims.RedisClaims`` shares the claims between replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class RoomClaims(Protocol):
    """Where room is taken (see the module docstring)."""

    def reserve(
        self,
        key: str,
        budgets: Mapping[str, int | None],
        body: int,
        head: str | None,
        head_tokens: int,
        *,
        force: bool = False,
        idle_ttl: float,
        expires_in: float,
    ) -> frozenset[str]:
        """Reserve room for session ``key`` on each rank of ``budgets`` (rank -> its budget in
        tokens; None: unbounded) still having it; ``force``: on each, past its budget (the cost
        policy chose so). The reservation lapses after ``expires_in`` seconds unless claimed;
        claims untouched for ``idle_ttl`` seconds have ended. The ranks granted (empty: none has
        room any more)."""
        ...

    def claim(self, key: str, rank: str, body: int, head: str | None, head_tokens: int) -> None:
        """Session ``key`` holds ``body`` + its ``head`` on ``rank`` now (its reservation ends)."""
        ...

    def release(self, key: str) -> None:
        """Session ``key`` holds no room any more (ended, failed, deleted)."""
        ...

    def totals(self) -> dict[str, int]:
        """Claimed and reserved tokens per rank (a read, for tests and inspection)."""
        ...


class LocalClaims:
    """One process's claims: its own count decided, so every rank it allowed is granted."""

    def reserve(
        self,
        key: str,
        budgets: Mapping[str, int | None],
        body: int,
        head: str | None,
        head_tokens: int,
        *,
        force: bool = False,
        idle_ttl: float,
        expires_in: float,
    ) -> frozenset[str]:
        return frozenset(budgets)

    def claim(self, key: str, rank: str, body: int, head: str | None, head_tokens: int) -> None:
        pass

    def release(self, key: str) -> None:
        pass

    def totals(self) -> dict[str, int]:
        return {}
