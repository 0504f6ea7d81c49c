"""Stage 7, forward and stream: send the request to a rank and relay its answer.

A rank that refuses the connection, times out, answers 5xx or breaks before any byte reached the
client is retried on another healthy rank (``retries`` times). For a stream, the rank's first chunk
is awaited before the client's response starts: that is the only way to still retry, and it costs
the client nothing since its first byte could not come earlier. After that, chunks are relayed as
they arrive, never buffered; a break ends the stream with an SSE error event. A client that goes
away cancels the upstream request.

Upstream traffic goes through aiohttp: measured here, httpx's connection pool fell from 1,190 to
104 requests/s between concurrency 1 and 64 against the same rank, while aiohttp held 3,000-8,000.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy.errors import ProxyError, sse_error_event, upstream_failed
from proxy.metrics import Metrics
from proxy.route import Router
from proxy.sse_check import SseChecker
from routing.ranks import Rank

log = logging.getLogger("prefixgate.forward")

T = TypeVar("T")

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
#: Request headers never forwarded: hop-by-hop ones, and those aiohttp sets for the new connection.
DROPPED_REQUEST_HEADERS = HOP_BY_HOP | {"host", "content-length", "accept-encoding"}
#: Response headers never relayed: the proxy's own server sets these.
DROPPED_RESPONSE_HEADERS = HOP_BY_HOP | {"content-length", "content-encoding", "date", "server"}
#: The tail of a stream kept to read its usage chunk (vLLM sends it as one chunk near the end).
STREAM_TAIL_CHUNKS = 4


class MalformedStream(Exception):
    """The rank's SSE stream holds an event that does not decode."""


class ClientDisconnected(Exception):
    """The client went away before its answer was complete."""


def upstream_headers(request_headers: Any) -> dict[str, str]:
    """Client headers to send to the rank: all but hop-by-hop and connection-specific ones."""
    headers = {k: v for k, v in request_headers.items() if k not in DROPPED_REQUEST_HEADERS}
    headers["accept-encoding"] = "identity"  # the stream tail must be readable for usage
    headers.setdefault("content-type", "application/json")
    return headers


def response_headers(upstream: aiohttp.ClientResponse, backend: str) -> dict[str, str]:
    headers = {k.lower(): v for k, v in upstream.headers.items() if k.lower() not in DROPPED_RESPONSE_HEADERS}
    headers["x-prefixgate-backend"] = backend
    return headers


def is_event_stream(response: aiohttp.ClientResponse) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


def upstream_session(
    connect_timeout: float, read_timeout: float, headers: dict[str, str] | None = None
) -> aiohttp.ClientSession:
    """The one HTTP client of a prefixgate process towards its ranks; ``headers`` go on every request."""
    return aiohttp.ClientSession(
        headers=headers,
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30, enable_cleanup_closed=True),
        timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=read_timeout),
        auto_decompress=False,
        trust_env=False,  # never send rank traffic through an environment proxy
        skip_auto_headers=("User-Agent",),
    )


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Run ``work``; if the client disconnects first, cancel it and raise ``ClientDisconnected``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected()


@dataclass(slots=True)
class Opened:
    """A rank's answer, either complete (``body``) or a stream whose first chunk was read."""

    backend: Rank
    response: aiohttp.ClientResponse
    body: bytes | None = None
    first_chunk: bytes = b""
    chunks: AsyncIterator[bytes] | None = None
    checker: SseChecker | None = None


@dataclass(frozen=True, slots=True)
class StreamOutcome:
    tail: tuple[bytes, ...]
    error: str | None
    disconnected: bool
    first_byte_at: float


class Forwarder:
    def __init__(self, client: aiohttp.ClientSession, router: Router, metrics: Metrics, retries: int) -> None:
        self.client = client
        self.router = router
        self.metrics = metrics
        self.retries = retries

    async def open(
        self,
        ctx: Any,
        path: str,
        content: bytes,
        headers: dict[str, str],
        *,
        stream: bool,
    ) -> Opened:
        """Send to ``path`` on a rank, retrying on another one while nothing has reached the client."""
        tried: list[str] = []
        failure = "no attempt made"
        for attempt in range(self.retries + 1):
            try:
                backend = self.router.pick(ctx, tried)
            except ProxyError:
                if not tried:
                    raise
                break
            tried.append(backend.name)
            if attempt:
                self.metrics.retries.labels(path).inc()
            opened, failure = await self._attempt(backend, path, content, headers, stream)
            if opened is not None:
                if ctx is not None:
                    ctx.backend, ctx.attempts = backend, attempt + 1
                return opened
            log.warning("attempt %d at %s failed: %s", attempt + 1, backend.name, failure)
        raise upstream_failed(failure)

    async def _attempt(
        self, backend: Rank, path: str, content: bytes, headers: dict[str, str], stream: bool
    ) -> tuple[Opened | None, str]:
        backend.in_flight += 1
        response: aiohttp.ClientResponse | None = None
        keep_open = False
        try:
            response = await self.client.post(backend.url + path, data=content, headers=headers)
            status = response.status
            if status >= 500:
                await response.read()
                self.metrics.upstream_failures.labels(backend.name, f"http_{status}").inc()
                return None, f"{backend.name} answered HTTP {status}"
            if stream and status == 200 and is_event_stream(response):
                first = await response.content.readany()
                checker = SseChecker()
                problem = checker.feed(first)
                if problem is not None:  # nothing reached the client yet: another rank may do better
                    self.metrics.upstream_failures.labels(backend.name, "malformed").inc()
                    response.close()
                    return None, f"{backend.name} sent a {problem}"
                keep_open = True
                chunks = response.content.iter_any()
                return Opened(backend, response, first_chunk=first, chunks=chunks, checker=checker), ""
            body = await response.read()
            return Opened(backend, response, body=body), ""
        except aiohttp.ClientConnectorError as exc:
            backend.mark_down(f"connection failed: {exc.os_error or exc}")
            self.metrics.upstream_failures.labels(backend.name, "connect").inc()
            return None, f"cannot connect to {backend.name} ({exc.os_error or exc})"
        except TimeoutError:
            self.metrics.upstream_failures.labels(backend.name, "timeout").inc()
            return None, f"{backend.name} timed out"
        except aiohttp.ClientError as exc:
            self.metrics.upstream_failures.labels(backend.name, "protocol").inc()
            return None, f"{backend.name} failed: {type(exc).__name__}: {exc}"
        finally:
            if not keep_open:
                backend.in_flight -= 1
                if response is not None:
                    response.release()


class RelayResponse(Response):
    """Relays an opened upstream stream chunk by chunk, watching for the client going away."""

    def __init__(
        self,
        opened: Opened,
        on_done: Callable[[StreamOutcome], None],
        error_event: Callable[[str], bytes] = sse_error_event,
    ) -> None:
        """``error_event`` renders the event that ends a broken stream, in the client API's own shape."""
        self.opened = opened
        self.on_done = on_done
        self.error_event = error_event
        self.status_code = opened.response.status
        self.background = None
        self.init_headers(response_headers(opened.response, opened.backend.name))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        relay = asyncio.ensure_future(self._relay(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            done, _ = await asyncio.wait((relay, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not relay.done():
                relay.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await relay
            watcher.cancel()
        if relay in done and not relay.cancelled():
            relay.result()

    async def _relay(self, send: Send) -> None:
        opened = self.opened
        backend = opened.backend
        tail: deque[bytes] = deque(maxlen=STREAM_TAIL_CHUNKS)
        error: str | None = None
        completed = False
        first_byte_at = time.perf_counter()
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            first = opened.first_chunk
            if first:
                tail.append(first)
                await send({"type": "http.response.body", "body": first, "more_body": True})
            assert opened.chunks is not None
            try:
                checker = opened.checker
                async for chunk in opened.chunks:
                    problem = checker.feed(chunk) if checker is not None else None
                    if problem is not None:  # end the stream here rather than relay what clients cannot parse
                        raise MalformedStream(problem)
                    tail.append(chunk)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except (aiohttp.ClientError, TimeoutError, MalformedStream) as exc:
                error = f"{backend.name} broke mid-stream: {type(exc).__name__}"
                if isinstance(exc, MalformedStream):
                    error = f"{backend.name} sent a {exc}"
                log.warning("%s", error)
                await send({"type": "http.response.body", "body": self.error_event(error), "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            completed = True
        finally:
            backend.in_flight -= 1
            if completed and error is None:
                opened.response.release()
            else:  # the connection is in an unknown state: never reuse it
                opened.response.close()
            self.on_done(StreamOutcome(tuple(tail), error, not completed, first_byte_at))
