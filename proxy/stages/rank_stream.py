"""A rank's SSE stream after its first chunk: chunk by chunk, with one watchdog for stalls.

aiohttp enforces ``sock_read`` (the longest gap between bytes from a rank) by re-arming a timer on
every read: a ``TimerHandle`` made, pushed on the loop's heap and cancelled for every streamed token.
Without it, two proxies side by side on one-line requests streaming 64 chunks spent 8.18 against
9.03 ms of CPU per request (~14 us a chunk, 8 alternating rounds). A stream instead gets one timer
that wakes every quarter of the read timeout, and ends the stream (``SocketTimeoutError``, as
aiohttp's own timeout) when no byte arrived while the relay was waiting for one through a whole
read timeout. A stall is caught after 1 to 1.25 read timeouts, and a relay held up by a slow client
(not waiting) is never a stalled rank, as aiohttp's paused reading is not.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import SocketTimeoutError

#: Watchdog wake-ups per read timeout: a stall is caught within this fraction past the timeout.
CHECKS_PER_TIMEOUT = 4


class RankStream:
    """The rest of ``response``'s body as an async iterator of chunks; ``close`` stops its watchdog.

    ``read_timeout``: seconds without a byte while the relay waits before the stream ends with
    ``SocketTimeoutError``; None: no limit (and aiohttp's own timer is left as it is)."""

    __slots__ = ("_content", "_every", "_handle", "_loop", "_quiet", "_seen", "_timeout", "_waiting")

    def __init__(self, response: aiohttp.ClientResponse, read_timeout: float | None) -> None:
        self._content = response.content
        self._waiting = False  # the relay is suspended in a read: a stall counts only then
        self._handle: asyncio.TimerHandle | None = None
        connection = response.connection
        if read_timeout is None or connection is None or connection.protocol is None:
            return
        # From here this watchdog keeps the time; aiohttp re-reads the value on the next request
        # over the connection (as it does after handing a connection to a websocket).
        connection.protocol.read_timeout = None
        self._loop = asyncio.get_running_loop()
        self._timeout = read_timeout
        self._every = read_timeout / CHECKS_PER_TIMEOUT
        self._seen = self._content.total_bytes
        self._quiet = 0.0
        self._handle = self._loop.call_later(self._every, self._watch)

    def __aiter__(self) -> RankStream:
        return self

    async def __anext__(self) -> bytes:
        self._waiting = True
        try:
            chunk = await self._content.readany()
        finally:
            self._waiting = False
        if chunk:
            return chunk
        raise StopAsyncIteration

    def close(self) -> None:
        """Stop the watchdog (idempotent)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _watch(self) -> None:
        content = self._content
        if content.is_eof() or content.exception() is not None:
            self._handle = None  # the stream ended (or broke) unread: nothing left to watch
            return
        received = content.total_bytes
        if received != self._seen or not self._waiting:
            self._seen = received
            self._quiet = 0.0
        else:
            self._quiet += self._every
            if self._quiet >= self._timeout:
                self._handle = None
                content.set_exception(SocketTimeoutError("Timeout on reading data from socket"))
                return
        self._handle = self._loop.call_later(self._every, self._watch)
