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
interval catches what no event signals (sessions idling out with time).

Each replica orders its own waiters. Room another replica frees wakes them through ``watch``
(``claims.RoomClaims.watch``: Redis pub/sub), so the poll interval stays the one learned from the
idle TTL (the safety net for what nothing says, and the channel lost).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")

#: Subscribes a wake-up (called from any thread) to room freed elsewhere (``RoomClaims.watch``).
Watch = Callable[[Callable[[], None]], None]


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


class WaitQueue:
    """Waiters in priority and fair-share order, each retrying its ``attempt`` while at the head."""

    def __init__(self, poll_interval: float, watch: Watch | None = None) -> None:
        """``watch``: where room freed by other replicas is said (None: nowhere, one process)."""
        self.poll_interval = poll_interval
        self._watch_elsewhere = watch
        self._waiters: list[_Waiter] = []
        self._changed = asyncio.Event()
        self._arrivals = itertools.count()
        #: Per client key, the tag its next waiter starts from; and the virtual time (``V``).
        self._finish: dict[str, float] = {}
        self._virtual = 0.0
        #: The loop the waiters wait on, which the wakes from elsewhere reach (from another thread).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watching = False

    def __len__(self) -> int:
        return len(self._waiters)

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
        """From the first wait on, word that room freed elsewhere wakes the waiters."""
        self._loop = asyncio.get_running_loop()
        if not self._watching and self._watch_elsewhere is not None:
            self._watching = True
            self._watch_elsewhere(self._notify_from_thread)

    def _enter(self, ticket: Ticket) -> _Waiter:
        key = ticket.client or ""
        start = max(self._virtual, self._finish.get(key, 0.0))
        self._finish[key] = start + 1.0 / ticket.weight
        waiter = _Waiter((-ticket.priority, start, next(self._arrivals)), ticket)
        bisect.insort(self._waiters, waiter)
        return waiter

    def _leave(self, waiter: _Waiter, served: bool) -> None:
        self._waiters.remove(waiter)
        if served:
            self._virtual = max(self._virtual, waiter.order[1])

    async def wait(
        self,
        attempt: Callable[[], T | None],
        on_depth: Callable[[int], None],
        ticket: Ticket | None = None,
    ) -> T:
        """``attempt()``'s first non-None result, tried whenever this waiter is at the head: it waits
        until then, or until it is cancelled (its client left; admission's rotation is what bounds
        the wait). ``on_depth(n)`` is told the queue's length as it changes."""
        self._watch()
        waiter = self._enter(ticket or Ticket())
        on_depth(len(self._waiters))
        served = False
        try:
            while True:
                if self._waiters[0] is waiter:
                    found = attempt()
                    if found is not None:
                        served = True
                        return found
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), self.poll_interval)
        finally:
            self._leave(waiter, served)
            on_depth(len(self._waiters))
            self.notify()
