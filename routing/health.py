"""Active health checks: ``GET /health`` on every rank, every ``interval`` seconds.

A rank going down and coming back is logged by the rank itself (``Rank.mark_down``/``mark_up``),
whoever noticed (this checker, or forwarding on a refused connection); the checker's part is a reason
an operator can act on: the connection error, the timeout, or the status and body the rank answered.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from routing.ranks import Fleet, Rank

log = logging.getLogger("prefixgate.health")

#: Characters of a failing rank's ``/health`` body kept in the reason.
BODY_EXCERPT = 120


def failure_reason(exc: BaseException, timeout: float) -> str:
    """Why a health check's request failed, in words (not only the exception's class name)."""
    if isinstance(exc, TimeoutError):
        return f"health check got no answer within {timeout:g} s"
    if isinstance(exc, aiohttp.ClientConnectorError):
        os_error = exc.os_error
        return f"health check cannot connect to {exc.host}:{exc.port}: {os_error.strerror or os_error}"
    detail = str(exc)
    return f"health check failed: {type(exc).__name__}" + (f": {detail}" if detail else "")


async def check_rank(client: aiohttp.ClientSession, rank: Rank, timeout: float) -> bool:
    """Probe one rank and update its state; True when it answered 200."""
    try:
        async with client.get(f"{rank.url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            status = response.status
            body = await response.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        reason = failure_reason(exc, timeout)
    else:
        if status == 200:
            rank.mark_up()
            return True
        excerpt = " ".join(body[:BODY_EXCERPT].decode("utf-8", "replace").split())
        reason = f"GET /health answered {status}" + (f": {excerpt}" if excerpt else "")
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
