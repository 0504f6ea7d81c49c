"""Admission's claims on room: what decides whether a rank has room, where every replica sees it.

Admission (``proxy/admission/``) decides on its own count of the session table; a ``RoomClaims``
makes the decision's step that takes room authoritative. ``reserve`` checks each allowed rank's
claimed tokens against its budget and its claimed sessions against ``max_sessions`` and reserves in
one atomic step, returning the ranks granted;
``claim`` turns the reservation into the session's claim on the rank it went to (and keeps it
current as the session grows); ``release`` ends it. A claim's tokens are its projected working set:
its own ``body`` plus a shared ``head`` (an agent's system+tools) counted once per rank.

A new session that finds no room waits in the wait order (``wait_order.py``); ``reserve_or_enter``
takes its place there in the same step as the failed reservation, so that nobody arriving later
takes the room between the two.

``LocalClaims`` (the ``memory`` backend) grants what one process's own count allowed: there, that
count is the whole truth (and its queue the whole wait order). ``redis_claims.RedisClaims`` shares
the claims between replicas, and checks the shared wait order in the same step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from proxy.state.wait_order import Entry, Place


@dataclass(frozen=True, slots=True)
class Ask:
    """A new session's request for room: ``body`` tokens plus its ``head`` (``head_tokens``, counted
    once per rank) on any rank of ``budgets`` (rank -> its budget in tokens; None: unbounded)."""

    key: str
    budgets: Mapping[str, int | None]
    body: int
    head: str | None
    head_tokens: int
    #: Claims untouched this long (seconds) have ended; the reservation lapses after ``expires_in``.
    idle_ttl: float
    expires_in: float
    #: At most this many sessions claimed or reserved on one rank (None: no cap).
    max_sessions: int | None = None
    #: A new session's room takes its turn in the wait order shared by replicas
    #: (``wait_order.py``): within the budgets, granted only to the first ``place`` there, or with
    #: no place (not waiting) only while nobody waits.
    queued: bool = False
    place: str | None = None


@dataclass(frozen=True, slots=True)
class Reserved:
    """What ``reserve_or_enter`` did: the ranks granted, or (none granted) the place taken in the
    wait order (None: no shared order to stand in, or none granted past the budgets)."""

    granted: frozenset[str]
    place: Place | None = None


class RoomClaims(Protocol):
    """Where room is taken (see the module docstring)."""

    def reserve(self, ask: Ask) -> frozenset[str]:
        """Reserve room for ``ask.key`` on each rank asked that still has it, in one step; the
        reservation lapses unless claimed. The ranks granted (empty: none has room any more)."""
        ...

    def reserve_or_enter(self, ask: Ask, entry: Entry | None) -> Reserved:
        """``reserve(ask)``; granted none, a session not waiting yet takes its place in the shared
        wait order as ``entry`` in the same atomic step (``Reserved.place``; None: it enters none)."""
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

    def sessions(self) -> dict[str, int]:
        """Sessions claimed or reserved per rank, what ``Ask.max_sessions`` caps (a read)."""
        ...


class LocalClaims:
    """One process's claims: its own count decided, so every rank it allowed is granted."""

    def reserve(self, ask: Ask) -> frozenset[str]:
        return frozenset(ask.budgets)

    def reserve_or_enter(self, ask: Ask, entry: Entry | None) -> Reserved:
        return Reserved(frozenset(ask.budgets))

    def claim(self, key: str, rank: str, body: int, head: str | None, head_tokens: int) -> None:
        pass

    def release(self, key: str) -> None:
        pass

    def totals(self) -> dict[str, int]:
        return {}

    def sessions(self) -> dict[str, int]:
        return {}
