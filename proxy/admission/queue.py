"""The admission queue: new sessions that found no room wait here, higher priority first and, within
a priority, weighted-fair across client keys.

Each waiter holds a ``Ticket`` (its key's ``priority`` and ``weight``, from the keys file). Within a
priority, order is start-time fair queueing: a waiter's tag is ``max(V, F_key)``, where ``F_key``
grows by ``1 / weight`` with each waiter of that key and ``V`` is the tag of the waiter served last;
so a key with many waiters gets its share (its weight's) of the room that frees, never all of it,
and a key arriving later is not stuck behind another key's whole backlog. Equal tags go first come
first served.

Waiters look for room in that order, in one pass each time something may have freed some: the
first for any room (and, past the rotation bound, for a seat rotated to it), each one behind it for
room that those ahead of it, having looked first, could not use. So a smaller session is seated
where a larger one ahead of it does not fit, rather than the room staying empty until the larger
one's seat rotates to it (backfilling; the first's rotation is not delayed by it). Every change that
may free room (an answer, a release, a waiter leaving, a rank's new figures) starts a pass, and a
poll interval catches what no event signals (sessions idling out with time).

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
from typing import Any, TypeVar

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
    #: Looks for room: told whether the waiter is first (nobody unseated ahead of it).
    attempt: Callable[[bool], Any] = field(compare=False)
    #: Its seat once a pass found one (set by whichever waiter's task ran the pass).
    seated: asyncio.Future[Any] = field(compare=False)


class WaitQueue:
    """Waiters in priority and fair-share order, looking for room in that order on every change."""

    def __init__(self, poll_interval: float, watch: Watch | None = None) -> None:
        """``watch``: where room freed by other replicas is said (None: nowhere, one process)."""
        self.poll_interval = poll_interval
        self._watch_elsewhere = watch
        self._waiters: list[_Waiter] = []
        self._changed = asyncio.Event()
        #: How many times the waiters were woken for a change: a count made since is still current.
        self.changes = 0
        #: The change count and the time of the last pass: one pass serves every waiter it woke.
        self._passed: tuple[int, float] = (-1, 0.0)
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
        """Something changed that may have freed room: wake every waiter, for a new pass."""
        changed, self._changed = self._changed, asyncio.Event()
        self.changes += 1
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

    def _enter(self, ticket: Ticket, attempt: Callable[[bool], Any]) -> _Waiter:
        key = ticket.client or ""
        start = max(self._virtual, self._finish.get(key, 0.0))
        self._finish[key] = start + 1.0 / ticket.weight
        seated: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        waiter = _Waiter((-ticket.priority, start, next(self._arrivals)), ticket, attempt, seated)
        bisect.insort(self._waiters, waiter)
        return waiter

    def _leave(self, waiter: _Waiter, served: bool) -> None:
        self._waiters.remove(waiter)
        if served:
            self._virtual = max(self._virtual, waiter.order[1])

    def _pass(self) -> bool:
        """Each waiter in order looks for room, unless a pass already ran since the last change and
        within the poll interval (False then). A waiter is first while every one ahead of it was
        seated."""
        now = asyncio.get_running_loop().time()
        changes, at = self._passed
        if changes == self.changes and now - at < self.poll_interval:
            return False
        self._passed = (self.changes, now)
        first, seated = True, False
        for waiter in list(self._waiters):
            if waiter.seated.done():
                continue
            if self._look(waiter, first):
                seated = True
            else:
                first = False
        if seated:
            self.notify()  # the seated waiters' tasks return; the room they took is counted anew
        return True

    @staticmethod
    def _look(waiter: _Waiter, first: bool) -> bool:
        """``waiter`` looks for room; whether it found a seat."""
        try:
            found = waiter.attempt(first)
        except Exception as exc:  # that waiter's request fails, not the one running the pass
            waiter.seated.set_exception(exc)
            return False
        if found is None:
            return False
        waiter.seated.set_result(found)
        return True

    async def wait(
        self,
        attempt: Callable[[bool], T | None],
        on_depth: Callable[[int], None],
        ticket: Ticket | None = None,
        abandoned: Callable[[T], None] | None = None,
        looked: bool = False,
    ) -> T:
        """The first seat a pass finds for this waiter: ``attempt(first)``'s first non-None result
        (``first``: nobody unseated waits ahead of it). It waits until then, or until it is
        cancelled (its client left; admission's rotation is what bounds the wait). ``on_depth(n)`` is
        told the queue's length as it changes; ``abandoned(seat)``, of a seat a pass found for it that
        it was cancelled before taking. ``looked``: it has just looked, alone, on this change (no
        await since), so its look is this change's pass rather than a count made twice."""
        self._watch()
        waiter = self._enter(ticket or Ticket(), attempt)
        on_depth(len(self._waiters))
        served = False
        try:
            if looked and len(self._waiters) == 1:
                self._passed = (self.changes, asyncio.get_running_loop().time())
            elif not self._pass():  # those ahead looked at room since the last change: it looks now
                self._look(waiter, first=self._waiters[0] is waiter)
            while True:
                if waiter.seated.done():
                    served = waiter.seated.exception() is None
                    result: T = waiter.seated.result()
                    return result
                changed = self._changed
                # not ``wait_for``: on Python 3.11 it loses a cancellation that comes with a wake
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.poll_interval):
                        await changed.wait()
                self._pass()
        finally:
            seated = waiter.seated
            if not served and abandoned is not None and seated.done() and seated.exception() is None:
                abandoned(seated.result())
            self._leave(waiter, served)
            on_depth(len(self._waiters))
            self.notify()
