"""The admission queue: new sessions that found no room wait here, first come first served.

Only the waiter at the head checks for room (so a small late session cannot overtake a large early
one); every change that may free room (an answer, a release, a waiter leaving) wakes the waiters,
and a poll interval catches what no event signals (sessions idling out with time).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WaitQueue:
    """A FIFO of waiters, each retrying its ``attempt`` while at the head."""

    def __init__(self, poll_interval: float) -> None:
        self.poll_interval = poll_interval
        self._waiters: deque[object] = deque()
        self._changed = asyncio.Event()

    def __len__(self) -> int:
        return len(self._waiters)

    def notify(self) -> None:
        """Something changed that may have freed room: wake every waiter to re-check."""
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait(
        self, attempt: Callable[[], T | None], timeout: float, on_depth: Callable[[int], None]
    ) -> T:
        """``attempt()``'s first non-None result, tried whenever this waiter is at the head; raises
        ``TimeoutError`` after ``timeout`` seconds. ``on_depth(n)`` is told the queue's length as it
        changes."""
        waiter = object()
        self._waiters.append(waiter)
        on_depth(len(self._waiters))
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self._waiters[0] is waiter:
                    found = attempt()
                    if found is not None:
                        return found
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(left, self.poll_interval))
        finally:
            self._waiters.remove(waiter)
            on_depth(len(self._waiters))
            self.notify()
