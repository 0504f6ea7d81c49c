"""Client connections: bounded in number and in how long a client may take to send its request.

uvicorn arms no timer on a new connection nor between a request's first byte and its last: a client
trickling its headers a byte a second (slowloris), or connecting and sending nothing, holds its
socket for ever, and enough of them exhaust the process's descriptors, after which real clients are
refused and every accept logs an error. ``GuardedHttpProtocol`` (uvicorn's httptools protocol, plus
three guards) closes such connections:

- ``header_timeout``: a request's headers must all arrive within this many seconds of its first byte
  (of the connection's opening, for its first request); else 408 and the connection is closed;
- ``body_timeout``: a client sending a body may not stay silent longer than this (while prefixgate
  reads it: time the app makes it wait does not count); else 408 and closed;
- ``max_connections``: past it, a new connection closes the longest-idle one (opened or answered,
  no request begun), or when none is idle is refused with a 503; the first time, and the first time
  after the count falls back, one log line says so.

Between requests the keep-alive timeout applies (uvicorn's, ``client_keepalive``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, cast

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from proxy.errors import error_body

log = logging.getLogger("prefixgate.connections")

#: A request body reaches the app whole, or in pieces of this size (the server buffers at most this
#: much of one before reading pauses until the app takes it): a 100k-token prompt is ~400 KB of JSON.
BODY_BATCH_BYTES = 1024 * 1024


def canned(status: int, reason: str, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response, with an OpenAI error body, that closes the connection."""
    body = orjson.dumps(error_body(message, "invalid_request_error", code))
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class ConnectionGuard:
    """The limits, and what every connection of one server shares: the cap's state."""

    header_timeout: float
    body_timeout: float
    max_connections: int
    at_cap: bool = False
    evicted: int = 0
    refused: int = 0

    def reached(self, count: int) -> None:
        if not self.at_cap:
            self.at_cap = True
            log.warning(
                "connection cap of %d reached (max_connections): each new connection now closes the "
                "longest-idle one, or is refused with a 503 when none is idle",
                self.max_connections,
            )

    def relieved(self, count: int) -> None:
        if self.at_cap and count < self.max_connections * 0.9:
            self.at_cap = False
            log.warning(
                "connections back under the cap (%d open): %d idle ones were closed and %d new ones "
                "refused while at it",
                count,
                self.evicted,
                self.refused,
            )
            self.evicted = self.refused = 0


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header timeout, a body timeout and a connection cap.

    A subclass of a private uvicorn class, kept because nothing public does its work: uvicorn has no
    header or body timeout, and its ``limit_concurrency`` refuses new connections without closing
    idle ones; only the protocol sees a request's first byte, its last header and each body chunk.
    It costs nothing measurable: proxy CPU per streamed chat turn against ``prefixgate sim``, this
    protocol against uvicorn's own in the same run (``python -m bench.http_path --rounds 9`` at ``c0b41fb``:
    medians of 9 rounds, concurrency 8), 3.97 against 3.95 ms for a 16-token answer (600 turns a
    round) and 12.0 against 12.0 ms for a ~100k-token conversation (40 turns a round).
    What it reads of uvicorn's (``cycle``, ``flow``, ``parser``, ``connections``, ``headers``,
    ``transport``) is pinned by ``tests/reliability/test_client_connections.py`` and
    ``tests/proxy/test_body_intake.py``, which fail if a uvicorn release moves it.

    One timer per connection, re-armed lazily: progress only moves ``_deadline`` forward, and the
    timer when it fires checks the deadline again, so a body arriving in many chunks costs no timer
    operations per chunk.
    """

    def __init__(self, guard: ConnectionGuard, *args: Any, **kwargs: Any) -> None:
        self.guard = guard
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        self._phase: str | None = None  # "headers" | "body" while a deadline applies
        #: When the connection last became idle (opened, or its response sent), None while a request
        #: is under way: what the cap closes first.
        self.idle_since: float | None = None

    # -- asyncio.Protocol ------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        tcp = cast(asyncio.Transport, transport)  # a stream server's: uvicorn's own parent says so
        guard = self.guard
        if len(self.connections) >= guard.max_connections and not self._make_room():
            guard.refused += 1
            guard.reached(len(self.connections))
            message = "too many connections to prefixgate (max_connections); retry shortly"
            tcp.write(canned(503, "Service Unavailable", message, "too_many_connections"))
            tcp.close()
            return
        super().connection_made(tcp)
        self.idle_since = time.monotonic()
        self._arm("headers", guard.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.transport is None:  # refused at the cap: never served
            return
        super().connection_lost(exc)
        self.guard.relieved(len(self.connections))

    def data_received(self, data: bytes) -> None:
        self.idle_since = None
        super().data_received(data)

    # -- httptools parser callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm("headers", self.guard.header_timeout)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self.parser is not None and self._expects_body():
            self._arm("body", self.guard.body_timeout)
        else:
            self._disarm()

    def on_body(self, body: bytes) -> None:
        # uvicorn's, with its 64 KiB high-water mark raised to BODY_BATCH_BYTES: it woke the app for
        # every socket read and paused reading past 64 KiB until the app took them, so a 400 KB body
        # came in 7+ receive() steps (a loop turn, a wake-up and two copies each, the client stalled
        # meanwhile). The app reads every body whole anyway (``read_body``), so it is woken once
        # the body is complete (``on_message_complete``) or this much of it waits.
        cycle = self.cycle
        if (self.parser.should_upgrade() and self._should_upgrade()) or cycle.response_complete:
            return
        cycle.body += body
        if len(cycle.body) >= BODY_BATCH_BYTES:
            self.flow.pause_reading()
            cycle.message_event.set()
        if self._phase == "body":
            self._deadline = self.loop.time() + self.guard.body_timeout

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self.idle_since = time.monotonic()

    # -- the guards ---------------------------------------------------------------------------------

    def _expects_body(self) -> bool:
        for name, value in self.headers:
            if name == b"content-length":
                return value.strip() not in (b"0", b"")
            if name == b"transfer-encoding":
                return True
        return False

    def _make_room(self) -> bool:
        """Close the longest-idle connection to make room for a new one; False when none is idle."""
        idle = [
            c for c in self.connections if isinstance(c, GuardedHttpProtocol) and c.idle_since is not None
        ]
        if not idle:
            return False
        oldest = min(idle, key=lambda c: c.idle_since or 0.0)
        oldest.idle_since = None
        self.guard.evicted += 1
        self.guard.reached(len(self.connections))
        oldest.transport.close()
        self.connections.discard(oldest)  # closing: it no longer counts against the cap
        return True

    def _arm(self, phase: str, timeout: float) -> None:
        self._phase = phase
        self._deadline = self.loop.time() + timeout
        if self._timer is None:
            self._timer = self.loop.call_at(self._deadline, self._expired)

    def _disarm(self) -> None:
        self._phase = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self._phase is None or self.transport is None or self.transport.is_closing():
            return
        now = self.loop.time()
        paused = self._phase == "body" and self.flow.read_paused  # waiting for the app, not the client
        if now < self._deadline or paused:
            wait = self.guard.body_timeout if paused else self._deadline - now
            self._deadline = max(self._deadline, now + wait)
            self._timer = self.loop.call_at(self._deadline, self._expired)
            return
        phase, self._phase = self._phase, None
        began = self.idle_since is None
        if phase == "headers" and not began:
            self.transport.close()  # connected and never sent a byte: nothing to answer
            return
        cycle = self.cycle
        if cycle is None or not cycle.response_started:
            what = "headers" if phase == "headers" else "body"
            setting = "header_timeout" if phase == "headers" else "body_timeout"
            message = f"the request's {what} did not arrive in time ({setting})"
            self.transport.write(canned(408, "Request Timeout", message, "request_timeout"))
        self.transport.close()


class GuardedProtocols:
    """Makes the ``GuardedHttpProtocol`` of each connection of one server, all sharing its guard
    (``uvicorn.Config(http=...)``). An instance, not a class made per server: ``serve --workers``
    pickles the config for the processes it spawns, and a class made at run time does not pickle."""

    def __init__(self, guard: ConnectionGuard) -> None:
        self.guard = guard

    def __call__(self, *args: Any, **kwargs: Any) -> GuardedHttpProtocol:
        return GuardedHttpProtocol(self.guard, *args, **kwargs)


def protocol_factory(header_timeout: float, body_timeout: float, max_connections: int) -> GuardedProtocols:
    """The protocol factory of one server with these limits."""
    return GuardedProtocols(ConnectionGuard(header_timeout, body_timeout, max_connections))
