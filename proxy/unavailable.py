"""Why no rank could take a request: the 503 (each rank it could have gone to, and why it did not)
and the warning that refusal leaves in the log.

A bare "no healthy backend" left an operator to guess which rank and why, and nothing was logged.
The client's message names each rank with its reason, its address taken out (where the ranks are
stays private, as on ``/health`` and ``/ready``); the log line keeps the reason whole. While every
rank is down every request is refused: the log says so once a second, with the count of the
others, not once per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable
from urllib.parse import urlsplit
from weakref import WeakKeyDictionary

from proxy.errors import ProxyError, no_healthy_backend
from routing.ranks import Fleet, Rank

log = logging.getLogger("prefixgate")

#: Seconds between two warnings about refused requests (the ones between are counted).
LOG_EVERY_S = 1.0
_BY_FLEET: WeakKeyDictionary[Fleet, Refusals] = WeakKeyDictionary()


def private(reason: str, rank: Rank) -> str:
    """``reason`` without ``rank``'s address (its URL, ``host:port``, or ``('host', port)`` as a
    socket error prints it): the rank's name stands there."""
    parts = urlsplit(rank.url)
    host, port = parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)
    for form in (rank.url, f"{host}:{port}", f"('{host}', {port})", f"[{host}]:{port}"):
        reason = reason.replace(form, rank.name)
    return reason


def why_down(rank: Rank, now: float) -> str:
    """``rank`` is down: since when and the reason its last failure gave (its address kept)."""
    since = f" for {now - rank.down_since:.0f} s" if rank.down_since is not None else ""
    return f"{rank.name} is down{since}: {rank.last_error or 'no reason recorded'}"


def no_rank(fleet: Fleet, what: str | None = None, allowed: Collection[str] | None = None) -> ProxyError:
    """``Refusals.no_rank`` with ``fleet``'s own throttle (one per app: its fleet's)."""
    refusals = _BY_FLEET.get(fleet)
    if refusals is None:
        refusals = _BY_FLEET[fleet] = Refusals()
    return refusals.no_rank(fleet, what or "a request", allowed)


class Refusals:
    """Builds the 503 for a request no rank can take, and logs it (throttled, see the module)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._logged_at: float | None = None
        self._unlogged = 0

    def no_rank(self, fleet: Iterable[Rank], what: str, allowed: Collection[str] | None = None) -> ProxyError:
        """The 503 for ``what`` (say ``POST /v1/chat/completions``) when no rank of ``fleet`` can
        take it: every rank down, or (``allowed``: the ranks admission let a new session go to)
        every allowed rank down, the others having no room."""
        now = time.time()
        ranks = list(fleet)
        if not ranks:
            whole = shown = "no rank is configured"
        else:
            down = [r for r in ranks if not r.healthy and (allowed is None or r.name in allowed)]
            full = [r.name for r in ranks if r.healthy and allowed is not None and r.name not in allowed]
            reasons = [why_down(r, now) for r in down]
            whole = "; ".join(reasons)
            shown = "; ".join(private(reason, r) for reason, r in zip(reasons, down, strict=True))
            if full:
                room = f"{', '.join(full)} {'has' if len(full) == 1 else 'have'} no room for a new session"
                whole, shown = (f"{text}; {room}" if text else room for text in (whole, shown))
        self.log(f"503 for {what}: no healthy backend: {whole}")
        return no_healthy_backend(shown)

    def log(self, line: str) -> None:
        """``line`` at warning, unless one was logged under ``LOG_EVERY_S`` ago (then counted, and
        the count told with the next line logged)."""
        now = self.clock()
        if self._logged_at is not None and now - self._logged_at < LOG_EVERY_S:
            self._unlogged += 1
            return
        if self._unlogged:
            line += f" (and {self._unlogged} more refused since the last such line)"
        self._logged_at, self._unlogged = now, 0
        log.warning("%s", line)
