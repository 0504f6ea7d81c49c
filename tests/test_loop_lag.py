"""The event-loop lag sampler (``proxy/loop_lag.py``): a stall of the loop shows in its histogram."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from proxy.loop_lag import NAME, LoopLag


def _bucket(registry: CollectorRegistry, le: str) -> float:
    value = registry.get_sample_value(NAME + "_bucket", {"le": le})
    assert value is not None
    return value


async def test_a_stall_of_the_loop_is_recorded_as_lag() -> None:
    registry = CollectorRegistry()
    lag = LoopLag(registry, interval=0.02)  # sleeps of 10-30 ms
    task = asyncio.create_task(lag.run())
    try:
        await asyncio.sleep(0.2)
        assert _bucket(registry, "+Inf") > 0  # it samples while the loop is free
        late_before = _bucket(registry, "+Inf") - _bucket(registry, "0.1")
        time.sleep(0.2)  # hold the loop: the sampler's timer falls due during this
        await asyncio.sleep(0.1)
    finally:
        task.cancel()
    # one more wake-up came at least 200 - 30 ms late: above the 0.1 s bucket
    assert _bucket(registry, "+Inf") - _bucket(registry, "0.1") > late_before


async def test_wake_ups_are_spread_around_the_interval() -> None:
    registry = CollectorRegistry()
    lag = LoopLag(registry, interval=0.01)
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay: float) -> None:
        sleeps.append(delay)
        await real_sleep(0)

    task = asyncio.create_task(lag.run())
    asyncio.sleep = recording_sleep  # type: ignore[assignment]
    try:
        while len(sleeps) < 200:
            await real_sleep(0)
    finally:
        asyncio.sleep = real_sleep  # type: ignore[assignment]
        task.cancel()
    assert all(0.005 <= s <= 0.015 for s in sleeps)
    assert len(set(sleeps)) > 150  # drawn, not one fixed period
    assert 0.009 < sum(sleeps) / len(sleeps) < 0.011
