"""Polling with a deadline, for conditions a test can only observe from outside (metrics, threads)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    predicate: Callable[[], T],
    what: str | Callable[[], str] = "condition not reached before the deadline",
    timeout: float = 10.0,
    interval: float = 0.05,
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """Poll ``predicate`` every ``interval`` s until it returns something true, and return that.

    Fails with ``what`` (a message, or a function giving it at that moment) after ``timeout`` s.
    An exception of ``retry_on`` raised by ``predicate`` counts as "not yet" (a server still
    starting refuses connections); any other propagates at once, so an ``assert`` inside
    ``predicate`` (the process under test died) fails the wait straight away.
    """
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(*retry_on):
            value = predicate()
            if value:
                return value
        assert time.monotonic() < deadline, what() if callable(what) else what
        time.sleep(interval)


async def wait_until_async(
    predicate: Callable[[], T],
    what: str = "condition not reached before the deadline",
    timeout: float = 10.0,
    interval: float = 0.01,
) -> T:
    """``wait_until`` for a test on the event loop: it yields to the loop between polls (a blocking
    sleep would stop the very tasks it waits for)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, what
        await asyncio.sleep(interval)
