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

from collections.abc import Callable, Sequence
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


@dataclass(frozen=True, slots=True)
class Entry:
    """Who would take a place: a new waiter of ``client`` (its key's ``priority`` and fair-share
    ``weight``), its place held ``lease_s`` seconds unless renewed (``WaitOrder.enter``'s arguments,
    for the reservation that enters the order when it finds no room: ``claims.RoomClaims``)."""

    client: str | None
    priority: int
    weight: float
    lease_s: float


class WaitOrder(Protocol):
    """Where waiters stand across replicas (see the module docstring)."""

    #: Whether it keeps places beside its backend's claims: a place the claims' step enters
    #: (``RoomClaims.reserve_or_enter``) is then this order's to renew and leave.
    shared_places: bool

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

    def watch(self, wake: Callable[[], None]) -> None:
        """Call ``wake()`` (from any thread) whenever room may have freed, or the first place
        changed, on another replica: what no event of this process says."""
        ...


class LocalOrder:
    """No shared order: each process's queue orders its own waiters."""

    shared_places = False

    def enter(self, client: str | None, priority: int, weight: float, lease_s: float) -> Place | None:
        return None

    def renew(self, places: Sequence[Place], lease_s: float) -> None:
        pass

    def leave(self, place: Place, served: bool) -> None:
        pass

    def watch(self, wake: Callable[[], None]) -> None:
        pass  # no other replica: this process's own events are all there is
