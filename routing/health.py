"""Active health checks: ``GET /health`` on every rank, every ``interval`` seconds."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from routing.ranks import Fleet, Rank

log = logging.getLogger("prefixgate.health")


async def check_rank(client: aiohttp.ClientSession, rank: Rank, timeout: float) -> bool:
    """Probe one rank and update its state; True when it answered 200."""
    try:
        async with client.get(f"{rank.url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            status = response.status
            await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        reason = f"health check failed: {type(exc).__name__}"
    else:
        if status == 200:
            if not rank.healthy:
                log.info("rank %s is healthy again", rank.name)
            rank.mark_up()
            return True
        reason = f"health check answered {status}"
    if rank.healthy:
        log.warning("rank %s is down: %s", rank.name, reason)
    rank.mark_down(reason)
    return False


async def check_all(client: aiohttp.ClientSession, pool: Fleet, timeout: float) -> None:
    await asyncio.gather(*(check_rank(client, b, timeout) for b in pool))


async def run_health_checks(
    client: aiohttp.ClientSession, pool: Fleet, interval: float, timeout: float
) -> None:
    """Forever: probe every rank, then sleep. Cancelled at shutdown."""
    while True:
        await check_all(client, pool, timeout)
        await asyncio.sleep(interval)
