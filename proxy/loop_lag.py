"""How late the event loop runs what is due: the wait every request on this process adds to its own.

One task sleeps about ``interval`` seconds at a time and records how much later than asked it woke
up, in ``prefixgate_event_loop_lag_seconds`` (a histogram on the process's metrics registry):
anything that holds the loop (a long parse, a tokenization not offloaded, a garbage collection, a
burst of ready callbacks) shows there. The load investigation (docs/investigations.md) read
its p99 before and after each phase.

Each sleep is drawn uniformly between half and one and a half ``interval``, so the wake-ups fall at
random moments rather than in step with the process's periodic work (health checks, admission's
poll): the histogram is then the lag a timer due at any moment meets, whatever the sampling rate.
The rate only decides how many samples a minute holds (600 at the default) and what the sampler
costs: a wake-up of an otherwise idle process took ~0.2 ms of CPU on a 2-vCPU VM, so sampling every
10 ms kept an idle proxy at ~2-3 % of a core (the paced-load investigation's idle phase,
docs/investigations.md). Under load the wake-ups ride on the loop's own and cost little.
"""

from __future__ import annotations

import asyncio
import random

from prometheus_client import CollectorRegistry, Histogram

#: Mean seconds between wake-ups.
DEFAULT_INTERVAL_S = 0.1
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
NAME = "prefixgate_event_loop_lag_seconds"


class LoopLag:
    """The histogram and the task feeding it (``run``)."""

    def __init__(self, registry: CollectorRegistry, interval: float = DEFAULT_INTERVAL_S) -> None:
        self.interval = interval
        self.lag = Histogram(
            NAME,
            "How much later than due the event loop woke a timer, sampled at random moments "
            f"{interval * 1000:g} ms apart on average",
            buckets=LAG_BUCKETS,
            registry=registry,
        )

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        interval, observe, draw = self.interval, self.lag.observe, random.Random().random
        while True:
            wait = interval * (0.5 + draw())
            due = loop.time() + wait
            await asyncio.sleep(wait)
            observe(max(loop.time() - due, 0.0))
