"""How late the event loop runs what is due: the wait every request on this process adds to its own.

One task sleeps ``interval`` seconds at a time and records how much later than asked it woke up, in
``prefixgate_event_loop_lag_seconds`` (a histogram on the process's metrics registry): anything that
holds the loop (a long parse, a tokenization not offloaded, a garbage collection, a burst of ready
callbacks) shows there. ``bench/load.py`` reads it before and after a phase for its p99.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Histogram

#: Seconds between wake-ups: a stall shorter than this may fall between two of them.
DEFAULT_INTERVAL_S = 0.01
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
NAME = "prefixgate_event_loop_lag_seconds"


class LoopLag:
    """The histogram and the task feeding it (``run``)."""

    def __init__(self, registry: CollectorRegistry, interval: float = DEFAULT_INTERVAL_S) -> None:
        self.interval = interval
        self.lag = Histogram(
            NAME,
            f"How much later than due the event loop woke a timer, sampled every {interval * 1000:g} ms",
            buckets=LAG_BUCKETS,
            registry=registry,
        )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        interval, observe = self.interval, self.lag.observe
        while True:
            due = loop.time() + interval
            await asyncio.sleep(interval)
            observe(max(loop.time() - due, 0.0))
