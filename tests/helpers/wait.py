"""Polling with a deadline, for conditions a test can only observe from outside (metrics, threads)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_until(
    predicate: Callable[[], object],
    what: str = "condition not reached before the deadline",
    timeout: float = 10.0,
    interval: float = 0.05,
) -> None:
    """Poll ``predicate`` every ``interval`` s until true; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(interval)
