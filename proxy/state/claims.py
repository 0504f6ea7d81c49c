"""Admission's claims on room: what decides whether a rank has room, where every replica sees it.

Admission (``proxy/admission/``) decides on its own count of the session table; a ``RoomClaims``
makes the decision's step that takes room authoritative. ``reserve`` checks each allowed rank's
claimed tokens against its budget and its claimed sessions against ``max_sessions`` and reserves in
one atomic step, returning the ranks granted;
``claim`` turns the reservation into the session's claim on the rank it went to (and keeps it
current as the session grows); ``release`` ends it. A claim's tokens are its projected working set:
its own ``body`` plus a shared ``head`` (an agent's system+tools) counted once per rank.

A session that finds no room waits in its own replica's queue (``proxy/admission/queue.py``); room
another replica frees reaches it through ``watch``.

``LocalClaims`` (the ``memory`` backend) grants what one process's own count allowed: there, that
count is the whole truth. ``redis/claims.py``'s ``RedisClaims`` shares the claims between replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol


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


class RoomClaims(Protocol):
    """Where room is taken (see the module docstring)."""

    def reserve(self, ask: Ask) -> frozenset[str]:
        """Reserve room for ``ask.key`` on each rank asked that still has it, in one step; the
        reservation lapses unless claimed. The ranks granted (empty: none has room any more)."""
        ...

    def claim(self, key: str, rank: str, body: int, head: str | None, head_tokens: int) -> None:
        """Session ``key`` holds ``body`` + its ``head`` on ``rank`` now (its reservation ends)."""
        ...

    def release(self, key: str) -> None:
        """Session ``key`` holds no room any more (ended, failed, deleted)."""
        ...

    def watch(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` (from any thread) whenever another replica may have freed room: what no
        event of this process says."""
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

    def claim(self, key: str, rank: str, body: int, head: str | None, head_tokens: int) -> None:
        pass

    def release(self, key: str) -> None:
        pass

    def watch(self, wake: Callable[[], None]) -> None:
        pass  # no other replica: this process's own events are all there is

    def totals(self) -> dict[str, int]:
        return {}

    def sessions(self) -> dict[str, int]:
        return {}
