"""Active health checks: ``GET /health`` on every rank, every ``interval`` seconds.

The probes run in threads of their own, never on the event loop: a proxy whose loop lags behind its
traffic (seconds, at a thousand busy sessions on two cores) would otherwise time its own lag as the
rank's and take every healthy rank out of routing at once, refusing all traffic 503 until the next
round. A thread's socket timeouts measure the rank alone; the verdict is applied on the loop.

A rank going down and coming back is logged by the rank itself (``Rank.mark_down``/``mark_up``),
whoever noticed (this checker, or forwarding on a refused connection); the checker's part is a reason
an operator can act on: the connection error, the timeout, or the status and body the rank answered.

``on_up(rank)`` is told each time a rank becomes healthy: at its first good probe, and after it was
down (whoever marked it down): what prefixgate knows of a rank is learned then
(``routing.rank_facts``), since a rank that comes back may have restarted with another model or pool.
"""

from __future__ import annotations

import asyncio
import http.client
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlsplit

from routing.ranks import Fleet, Rank

log = logging.getLogger("prefixgate.health")

#: Characters of a failing rank's ``/health`` body kept in the reason.
BODY_EXCERPT = 120
#: Bytes of a ``/health`` answer read: what the reason keeps, and no more.
BODY_READ = 4096
#: Probe threads at most: a probe is one short blocking request, and the ranks are probed together.
MAX_PROBE_THREADS = 8


@dataclass(frozen=True, slots=True)
class Probe:
    """What one ``GET /health`` found: the status and the start of the body, or why there was none."""

    status: int | None = None
    body: bytes = b""
    failure: str | None = None


def probe(url: str, headers: Mapping[str, str], timeout: float) -> Probe:
    """``GET {url}/health``, blocking, answered within ``timeout`` seconds in all (a worker thread's)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "", parts.port
    https = parts.scheme == "https"
    connection_type = http.client.HTTPSConnection if https else http.client.HTTPConnection
    connection = connection_type(host, port, timeout=timeout)
    deadline = time.monotonic() + timeout
    late = Probe(failure=f"health check got no answer within {timeout:g} s")
    try:
        try:
            connection.connect()
        except TimeoutError:
            return late
        except OSError as exc:
            where = f"{host}:{port or (443 if https else 80)}"
            return Probe(failure=f"health check cannot connect to {where}: {exc.strerror or exc}")
        # Held here, not read from the connection: an answer that closes the connection
        # (``Connection: close``, HTTP/1.0) hands the socket to the response and clears
        # ``connection.sock``, while the body is still to be read through it.
        sock = connection.sock
        assert sock is not None
        try:
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            connection.request("GET", parts.path.rstrip("/") + "/health", headers=dict(headers))
            response = connection.getresponse()
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            return Probe(response.status, response.read(BODY_READ))
        except TimeoutError:
            return late
        except (OSError, http.client.HTTPException) as exc:
            detail = str(exc)
            return Probe(
                failure=f"health check failed: {type(exc).__name__}" + (f": {detail}" if detail else "")
            )
    finally:
        connection.close()


def apply(rank: Rank, found: Probe) -> bool:
    """Update ``rank``'s state from what its probe found (on the event loop); True when up."""
    if found.status == 200:
        rank.mark_up()
        return True
    if found.failure is not None:
        reason = found.failure
    else:
        excerpt = " ".join(found.body[:BODY_EXCERPT].decode("utf-8", "replace").split())
        reason = f"GET /health answered {found.status}" + (f": {excerpt}" if excerpt else "")
    rank.mark_down(reason)
    return False


class HealthChecker:
    """Probes a fleet's ranks from a small pool of threads; ``close()`` when done."""

    def __init__(self, fleet: Fleet, timeout: float, headers: Mapping[str, str] | None = None) -> None:
        """``headers`` go on every probe (the ranks' API key, as on forwarded requests)."""
        self.fleet = fleet
        self.timeout = timeout
        self.headers = dict(headers or {})
        #: Told on the event loop each time a rank becomes healthy (see the module docstring).
        self.on_up: Callable[[Rank], None] | None = None
        #: The ranks up at their last probe by this checker.
        self._up: set[str] = set()
        threads = max(1, min(MAX_PROBE_THREADS, len(fleet)))
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="prefixgate-health")

    async def check(self, rank: Rank) -> bool:
        """Probe one rank and update its state; True when it answered 200.

        A probe that fails in a way ``probe`` does not know marks the rank down with the error and
        is logged: it must never end the checker, or a rank once down would never come back.
        """
        loop = asyncio.get_running_loop()
        try:
            found = await loop.run_in_executor(self._pool, probe, rank.url, self.headers, self.timeout)
        except Exception as exc:
            log.exception("health check of rank %s failed unexpectedly", rank.name)
            found = Probe(failure=f"health check failed: {type(exc).__name__}: {exc}")
        # a rank starts out healthy until probed, and forwarding may mark it down between probes
        was_up = rank.healthy and rank.name in self._up
        up = apply(rank, found)
        if not up:
            self._up.discard(rank.name)
        elif not was_up:
            self._up.add(rank.name)
            if self.on_up is not None:
                self.on_up(rank)
        return up

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(rank) for rank in self.fleet))

    async def run(self, interval: float) -> None:
        """Forever: probe every rank, then sleep. Cancelled at shutdown."""
        while True:
            await self.check_all()
            await asyncio.sleep(interval)

    def close(self) -> None:
        """Stop the probe threads (a probe under way ends within its timeout)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
