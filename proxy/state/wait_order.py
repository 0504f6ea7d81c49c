"""Admission's wait order: where the waiters for room stand, where every replica sees them.

Admission's queue (``proxy/admission/queue.py``) serves its waiters by priority, then weighted-fair
across client keys, then first come; a ``WaitOrder`` makes that order one across replicas. A waiter
``enter``s and gets its ``Place`` (its position's key, ``(-priority, fair-share tag, arrival)``),
has its lease renewed while it waits (a replica renews all its waiters' at once; a dead replica's
waiters lapse, never blocking the others) and ``leave``s when served or gone. The order is
enforced where room is taken: a reservation within the budgets goes only to the first place, or to
a session that is not waiting while nobody waits (``claims.Ask.queued`` and ``Ask.place``, checked
in the same atomic step as the room).

``LocalOrder`` (the ``memory`` backend) has no shared order: each process's queue is the whole
order. ``redis_queue.RedisWaitOrder`` shares it between replicas.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, slots=True)
class Place:
    """A waiter's place in the shared order: its id there and where it stands (``(-priority,
    fair-share tag, arrival)``, smaller first, the same across replicas)."""

    id: str
    order: tuple[int, float, int]
    #: The member that holds the place in the shared order (what a renewal restores if it lapsed).
    member: str


class WaitOrder(Protocol):
    """Where waiters stand across replicas (see the module docstring)."""

    def enter(self, client: str | None, priority: int, weight: float, lease_s: float) -> Place | None:
        """A place for a new waiter of ``client`` (its key's ``priority`` and fair-share
        ``weight``), held ``lease_s`` seconds unless renewed; None: no shared order now (the memory
        backend, or Redis unreachable: this replica's own queue decides)."""
        ...

    def renew(self, places: Sequence[Place], lease_s: float) -> None:
        """The waiters at ``places`` (one replica's) still wait: their leases run ``lease_s`` from
        now, in one step (a lapsed place is restored where it stood)."""
        ...

    def leave(self, place: Place, served: bool) -> None:
        """The waiter at ``place`` waits no more (``served``: it took room, which moves the
        fair-share clock on)."""
        ...


class LocalOrder:
    """No shared order: each process's queue orders its own waiters."""

    def enter(self, client: str | None, priority: int, weight: float, lease_s: float) -> Place | None:
        return None

    def renew(self, places: Sequence[Place], lease_s: float) -> None:
        pass

    def leave(self, place: Place, served: bool) -> None:
        pass
