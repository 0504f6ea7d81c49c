"""Active health checks: ``GET /health`` on every rank, every ``interval`` seconds."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from routing.ranks import Fleet, Rank

log = logging.getLogger("prefixgate.health")


async def check_backend(client: aiohttp.ClientSession, backend: Rank, timeout: float) -> bool:
    """Probe one rank and update its state; True when it answered 200."""
    try:
        async with client.get(
            f"{backend.url}/health", timeout=aiohttp.ClientTimeout(total=timeout)
        ) as response:
            status = response.status
            await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        reason = f"health check failed: {type(exc).__name__}"
    else:
        if status == 200:
            if not backend.healthy:
                log.info("backend %s is healthy again", backend.name)
            backend.mark_up()
            return True
        reason = f"health check answered {status}"
    if backend.healthy:
        log.warning("backend %s is down: %s", backend.name, reason)
    backend.mark_down(reason)
    return False


async def check_all(client: aiohttp.ClientSession, pool: Fleet, timeout: float) -> None:
    await asyncio.gather(*(check_backend(client, b, timeout) for b in pool))


async def run_health_checks(
    client: aiohttp.ClientSession, pool: Fleet, interval: float, timeout: float
) -> None:
    """Forever: probe every rank, then sleep. Cancelled at shutdown."""
    while True:
        await check_all(client, pool, timeout)
        await asyncio.sleep(interval)
