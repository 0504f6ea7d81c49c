"""The admission queue: new sessions that found no room wait here, higher priority first and, within
a priority, weighted-fair across client keys.

Each waiter holds a ``Ticket`` (its key's ``priority`` and ``weight``, from the keys file). Within a
priority, order is start-time fair queueing: a waiter's tag is ``max(V, F_key)``, where ``F_key``
grows by ``1 / weight`` with each waiter of that key and ``V`` is the tag of the waiter served last;
so a key with many waiters gets its share (its weight's) of the room that frees, never all of it,
and a key arriving later is not stuck behind another key's whole backlog. Equal tags go first come
first served.

Only the waiter at the head checks for room (so a small later session cannot overtake a large
earlier one). Every change that may free room
(an answer, a release, a waiter leaving, a rank's new figures) wakes the waiters, and a poll
interval catches what no event signals (sessions idling out with time, and what other replicas do).

With a shared ``WaitOrder`` (Redis: ``proxy/state/redis_queue.py``) each waiter also takes a place in
the order of every replica's waiters, which then orders this queue too (its fair-share tags are kept
there, so they compare across replicas); the head here is the first of this replica's waiters, and
the room it finds is granted only if no replica has a waiter before it (checked where room is taken,
``claims.Ask.place``). A session that finds no room there takes its place in the same step
(``claims.RoomClaims.reserve_or_enter``: nobody arriving later takes the room between the two) and
waits from it (``wait(entered=...)``). What other replicas free wakes the waiters here through the
order (``WaitOrder.watch``: Redis pub/sub), so the poll interval stays the one learned from the idle
TTL (the safety net for what nothing says: leases lapsing, and the channel lost). The queue renews
its waiters' leases while they wait (``LEASE_S``, all in one step), so a dead replica's waiters
lapse. Without a place (no shared order, or Redis unreachable) this process's order alone decides,
as before.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from proxy.state.wait_order import Entry, LocalOrder, Place, WaitOrder

T = TypeVar("T")

#: Seconds a waiter's place in a shared order stands unless renewed (every third of it while it
#: waits): how long a dead replica's waiters stay in the others' way. Wall-clock time, not the
#: traffic's: it measures whether a process is alive, which a replay does not compress.
LEASE_S = 3.0


@dataclass(frozen=True, slots=True)
class Ticket:
    """Who waits: the client key's label, its priority (higher first) and its fair-share weight."""

    client: str | None = None
    priority: int = 0
    weight: float = 1.0


@dataclass(order=True, slots=True)
class _Waiter:
    order: tuple[int, float, int]
    ticket: Ticket = field(compare=False)
    place: Place | None = field(compare=False, default=None)


class WaitQueue:
    """Waiters in priority and fair-share order, each retrying its ``attempt`` while at the head."""

    def __init__(self, poll_interval: float, order: WaitOrder | None = None) -> None:
        self.poll_interval = poll_interval
        self.order: WaitOrder = order if order is not None else LocalOrder()
        self._waiters: list[_Waiter] = []
        self._changed = asyncio.Event()
        self._arrivals = itertools.count()
        #: Per client key, the tag its next waiter starts from; and the virtual time (``V``).
        self._finish: dict[str, float] = {}
        self._virtual = 0.0
        #: When this queue last renewed its waiters' places in the shared order (all at once).
        self._renewed = time.monotonic()
        #: The loop the waiters wait on, which the order's wakes reach (from its listener's thread).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watching = False

    def __len__(self) -> int:
        return len(self._waiters)

    def entry(self, ticket: Ticket) -> Entry | None:
        """What ``ticket``'s waiter enters the shared order as, when the step that finds no room
        enters it (``wait(entered=...)``); None: the order keeps no places of its own."""
        if not self.order.shared_places:
            return None
        return Entry(ticket.client, ticket.priority, ticket.weight, LEASE_S)

    def notify(self) -> None:
        """Something changed that may have freed room: wake every waiter to re-check."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _notify_from_thread(self) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits on it any more
                loop.call_soon_threadsafe(self.notify)

    def _watch(self) -> None:
        """From the first wait on, the order's word that room freed elsewhere wakes the waiters."""
        self._loop = asyncio.get_running_loop()
        if not self._watching:
            self._watching = True
            self.order.watch(self._notify_from_thread)

    def _enter(self, ticket: Ticket, entered: Place | None) -> _Waiter:
        key = ticket.client or ""
        start = max(self._virtual, self._finish.get(key, 0.0))
        self._finish[key] = start + 1.0 / ticket.weight
        place = entered or self.order.enter(ticket.client, ticket.priority, ticket.weight, LEASE_S)
        if not self._waiters:
            self._renewed = time.monotonic()  # a fresh lease: the next renewal is a third of one away
        order = place.order if place is not None else (-ticket.priority, start, next(self._arrivals))
        waiter = _Waiter(order, ticket, place)
        bisect.insort(self._waiters, waiter)
        return waiter

    def _leave(self, waiter: _Waiter, served: bool) -> None:
        self._waiters.remove(waiter)
        if waiter.place is not None:
            self.order.leave(waiter.place, served)
        if served:
            self._virtual = max(self._virtual, waiter.order[1])

    async def wait(
        self,
        attempt: Callable[[], T | None],
        on_depth: Callable[[int], None],
        ticket: Ticket | None = None,
        on_place: Callable[[str | None], None] | None = None,
        entered: Place | None = None,
    ) -> T:
        """``attempt()``'s first non-None result, tried whenever this waiter is at the head: it waits
        until then, or until it is cancelled (its client left; admission's rotation is what bounds
        the wait). ``on_depth(n)`` is told the queue's length as it changes; ``on_place(id)``, before
        the first attempt, the waiter's place in the shared order (None: none), which its attempts name where
        room is taken (granted only if no replica has a waiter before it); ``entered``: the place
        it already took, in the step that found no room (``reserve_or_enter``)."""
        self._watch()
        waiter = self._enter(ticket or Ticket(), entered)
        if on_place is not None:
            on_place(waiter.place.id if waiter.place is not None else None)
        on_depth(len(self._waiters))
        served = False
        try:
            while True:
                if self._waiters[0] is waiter:
                    found = attempt()
                    if found is not None:
                        served = True
                        return found
                now = time.monotonic()
                if waiter.place is not None and now - self._renewed >= LEASE_S / 3:
                    self._renewed = now
                    self.order.renew([w.place for w in self._waiters if w.place is not None], LEASE_S)
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), self.poll_interval)
        finally:
            self._leave(waiter, served)
            on_depth(len(self._waiters))
            self.notify()
