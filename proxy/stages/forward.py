"""Stage 7, forward and stream: the request sent to the plan's ranks in turn until one answers, and
that rank's answer on its way to the client, its SSE stream relayed chunk by chunk.

``Forwarder.open`` sends the request. A rank that refuses the connection, times out, answers 5xx or
breaks before any byte reached the client is retried on the plan's next healthy rank (``retries``
times). For a stream, the rank's first chunk is awaited before the client's response starts: that is
the only way to still retry, and it costs the client nothing since its first byte could not come
earlier. The answer it hands on (``Opened``) is whole, or a stream whose first chunk was read.

Pooled connections to a rank are kept idle at most ``keepalive`` seconds, below the rank's own
keep-alive (uvicorn, which vLLM's API server runs on, closes idle connections after 5 s): a request
written on a connection the rank is closing meets its FIN and fails. Should one fail that way anyway
(a rank with a shorter keep-alive, a rank restarted behind the pool), the request goes again on a
fresh connection to the same rank before anything else: not a failure of the rank, and the session
does not move.

Every request to a rank (forwarded, health, facts, the tokenizer's) goes through aiohttp, the one
client: on the same jobs against ``prefixgate sim`` (streamed chat turns, ``/tokenize`` calls) it
spends 0.37x httpx's CPU at concurrency 8 and 0.18x at 64 (medians of 7 paired rounds:
``python -m bench.http_path --clients --concurrency 64 --turns 640`` at ``deae4c4``; that comparison
has since been deleted, its finding is this sentence).

A stream is then one thing from the rank to the client:

- read: ``RankStream``, the rank's chunks after the first, with one watchdog for stalls;
- checked: ``SseChecker``, each ``data:`` event well-formed, or the stream ends there;
- watched for its prefill's end: ``PrefillWatch``, the first chunk past its API's preamble;
- relayed: ``RelayResponse``, chunk by chunk as they arrive, never buffered or parsed beyond the
  check; the last few are kept to read the usage from (vLLM sends it last).

A break (the rank dies, stalls past ``read_timeout`` or sends an undecodable event) ends the stream
with an SSE error event in the client API's shape, and so does a stream the server cuts (the
shutdown deadline passed: uvicorn cancels the request), so the client knows its answer is
incomplete. A client that goes away cancels the upstream request. Whatever happens, the rank's
in-flight count is released and ``on_done`` runs exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass

import aiohttp
import msgspec
from aiohttp import SocketTimeoutError
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from proxy.apis.base import Translation
from proxy.context import RoutePlan
from proxy.errors import ProxyError, upstream_failed
from proxy.ops.metrics import Metrics
from proxy.stages.disconnect import cancel_on_disconnect, fired
from proxy.unavailable import private
from routing.ranks import Rank

log = logging.getLogger("prefixgate.forward")


# -- the records: a rank's answer, opened; a stream's outcome --------------------------------------


@dataclass(slots=True)
class Opened:
    """A rank's answer as ``Forwarder.open`` hands it on: complete (``body``), or a stream whose first
    chunk was read (``first_chunk``; ``chunks``, the rest; ``checker``, its events checked so far).

    An open stream holds its rank's in-flight count and its connection until ``close``: whoever
    takes it (the relay) must close it, whatever happens.
    """

    rank: Rank
    response: aiohttp.ClientResponse
    body: bytes | None = None
    first_chunk: bytes = b""
    chunks: AsyncIterator[bytes] | None = None
    checker: SseChecker | None = None
    #: Ranks tried until this one answered.
    attempts: int = 1
    closed: bool = False

    def close(self, reusable: bool = False) -> None:
        """Done with a stream (idempotent): the rank's in-flight count is released, the connection
        goes back to the pool when ``reusable`` (read to its end), else is closed."""
        if self.closed or self.chunks is None:
            return
        self.closed = True
        self.rank.in_flight -= 1
        if isinstance(self.chunks, RankStream):
            self.chunks.close()
        if reusable:
            self.response.release()
        else:
            self.response.close()


@dataclass(frozen=True, slots=True)
class StreamOutcome:
    """How a relayed stream ended: its first and last chunks, why it broke, whether the client left."""

    first: bytes
    tail: tuple[bytes, ...]
    error: str | None
    disconnected: bool
    first_byte_at: float


# -- the request, forwarded ------------------------------------------------------------------------

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
#: The ``user-agent`` a forwarded request carries when its client sent none.
USER_AGENT = "prefixgate"


def upstream_headers(request_headers: Mapping[str, str]) -> dict[str, str]:
    """Client headers to send to the rank: all but hop-by-hop and connection-specific ones."""
    headers = {k: v for k, v in request_headers.items() if k not in DROPPED_REQUEST_HEADERS}
    headers["accept-encoding"] = "identity"  # the stream tail must be readable for usage
    headers.setdefault("content-type", "application/json")
    headers.setdefault("user-agent", USER_AGENT)  # not aiohttp's: see upstream_session
    return headers


def response_headers(upstream: aiohttp.ClientResponse, rank: str) -> dict[str, str]:
    headers = {k.lower(): v for k, v in upstream.headers.items() if k.lower() not in DROPPED_RESPONSE_HEADERS}
    headers["x-prefixgate-backend"] = rank
    return headers


def is_event_stream(response: aiohttp.ClientResponse) -> bool:
    return response.headers.get("content-type", "").startswith("text/event-stream")


#: Seconds a pooled connection to a rank may idle before it is dropped: under uvicorn's 5 s.
DEFAULT_KEEPALIVE_S = 4.0


def upstream_session(
    connect_timeout: float,
    read_timeout: float,
    headers: dict[str, str] | None = None,
    keepalive: float | None = DEFAULT_KEEPALIVE_S,
) -> aiohttp.ClientSession:
    """The HTTP client of a prefixgate process towards its ranks; ``headers`` go on every request.

    ``keepalive``: seconds an idle connection is kept for the next request; None: every connection
    is new and closed after its answer (the forwarder's client for requests that met a stale one).
    """
    if keepalive is None:
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
    else:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=keepalive, enable_cleanup_closed=True)
    return aiohttp.ClientSession(
        headers=headers,
        connector=connector,
        timeout=aiohttp.ClientTimeout(total=None, connect=connect_timeout, sock_read=read_timeout),
        auto_decompress=False,
        trust_env=False,  # never send rank traffic through an environment proxy
        # One client carries every client's requests: a cookie a rank set for one must never go
        # along with another's (cookies are the clients' business, relayed as headers, not kept).
        cookie_jar=aiohttp.DummyCookieJar(),
        # No skip_auto_headers: a skip list sends every request down aiohttp's slow path (a copy of
        # its headers, ~20 us); forwarded requests name their agent instead (upstream_headers).
    )


def stale_connection(exc: BaseException) -> bool:
    """Whether ``exc``, raised before any response byte, is what writing on a connection the rank
    already closed gives: the peer gone (``ServerDisconnectedError``) or a reset / broken pipe
    (``ClientOSError``); never a refused connection, which is the rank's own failure."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return False
    return isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError)


def every_attempt_failed(path: str, failures: list[tuple[Rank, str]]) -> ProxyError:
    """The 502 when every rank tried failed, each named with its failure (in the client's message
    without its address), and the warning saying the client got it."""
    whole = "; ".join(failure for _, failure in failures) or "no rank was tried"
    log.warning("502 for %s: %s rank(s) tried, each failed: %s", path, len(failures), whole)
    shown = "; ".join(private(failure, rank) for rank, failure in failures) or "no rank was tried"
    return upstream_failed(
        shown if len(failures) < 2 else f"each of the {len(failures)} ranks tried failed: {shown}"
    )


class Forwarder:
    """Sends requests to ranks over the process's upstream clients: ``client`` (pooled), and
    ``fresh`` (a new connection each time) for a request whose pooled connection was stale."""

    def __init__(
        self,
        client: aiohttp.ClientSession,
        metrics: Metrics,
        retries: int,
        *,
        fresh: aiohttp.ClientSession | None = None,
        first_byte_timeout: float | None = None,
    ) -> None:
        self.client = client
        self.fresh = fresh
        self.metrics = metrics
        self.retries = retries
        self.first_byte_timeout = first_byte_timeout

    async def open(
        self,
        plan: RoutePlan,
        path: str,
        content: bytes,
        headers: dict[str, str],
        *,
        stream: bool,
    ) -> Opened:
        """Send to ``path`` on the plan's ranks in turn, while nothing has reached the client."""
        failures: list[tuple[Rank, str]] = []
        attempt = 0
        for rank in plan.ranks:
            if attempt > self.retries:
                break
            if attempt and not rank.healthy:
                continue  # marked down by another request since the plan was made
            if attempt:
                self.metrics.retries.labels(path).inc()
            attempt += 1
            opened, failure = await self._attempt(rank, path, content, headers, stream)
            if opened is not None:
                opened.attempts = attempt
                return opened
            log.warning("attempt %d at %s failed: %s", attempt, rank.name, failure)
            failures.append((rank, failure))
        raise every_attempt_failed(path, failures)

    async def _attempt(
        self, rank: Rank, path: str, content: bytes, headers: dict[str, str], stream: bool
    ) -> tuple[Opened | None, str]:
        rank.in_flight += 1
        response: aiohttp.ClientResponse | None = None
        keep_open = False
        try:
            if stream and self.first_byte_timeout is not None:
                # a rank that accepts but never starts answering (hung, yet up on /health) is left for
                # the next one after this, not after the read timeout meant for gaps between chunks
                async with asyncio.timeout(self.first_byte_timeout):
                    response = await self._post(rank, path, content, headers)
                    first = await self._first_chunk(response)
            else:
                response = await self._post(rank, path, content, headers)
                first = await self._first_chunk(response) if stream else None
            status = response.status
            if status >= 500:
                await response.read()
                self.metrics.upstream_failures.labels(rank.name, f"http_{status}").inc()
                return None, f"{rank.name} answered HTTP {status}"
            if first is not None:
                checker = SseChecker()
                problem = checker.feed(first)
                if problem is not None:  # nothing reached the client yet: another rank may do better
                    self.metrics.upstream_failures.labels(rank.name, "malformed").inc()
                    response.close()
                    return None, f"{rank.name} sent a {problem}"
                keep_open = True
                chunks = RankStream(response, self.client.timeout.sock_read)
                return Opened(rank, response, first_chunk=first, chunks=chunks, checker=checker), ""
            body = await response.read()
            return Opened(rank, response, body=body), ""
        except aiohttp.ClientConnectorError as exc:
            rank.mark_down(f"connection failed: {exc.os_error or exc}")
            self.metrics.upstream_failures.labels(rank.name, "connect").inc()
            return None, f"cannot connect to {rank.name} ({exc.os_error or exc})"
        except TimeoutError:
            self.metrics.upstream_failures.labels(rank.name, "timeout").inc()
            return None, f"{rank.name} timed out"
        except aiohttp.ClientError as exc:
            self.metrics.upstream_failures.labels(rank.name, "protocol").inc()
            return None, f"{rank.name} failed: {type(exc).__name__}: {exc}"
        finally:
            if not keep_open:
                rank.in_flight -= 1
                if response is not None:
                    response.release()

    async def _post(
        self, rank: Rank, path: str, content: bytes, headers: dict[str, str]
    ) -> aiohttp.ClientResponse:
        """POST on a pooled connection; when that connection turns out stale before any response
        byte, once more on a fresh one to the same rank."""
        url = rank.url + path
        try:
            return await self.client.post(url, data=content, headers=headers)
        except aiohttp.ClientError as exc:
            if self.fresh is None or not stale_connection(exc):
                raise
            log.debug(
                "%s: pooled connection failed before any byte (%s), sent again on a new one", rank.name, exc
            )
            self.metrics.upstream_reconnects.labels(rank.name).inc()
            return await self.fresh.post(url, data=content, headers=headers)

    @staticmethod
    async def _first_chunk(response: aiohttp.ClientResponse) -> bytes | None:
        """A stream's first chunk, read before the client's response starts (None: not a stream)."""
        if response.status != 200 or not is_event_stream(response):
            return None
        return await response.content.readany()


# -- the answer, relayed ---------------------------------------------------------------------------

#: The tail of a stream kept to read its usage chunk (vLLM sends it as one chunk near the end).
STREAM_TAIL_CHUNKS = 4


class MalformedStream(Exception):
    """The rank's SSE stream holds an event that does not decode."""


class RelayResponse(Response):
    """Relays an opened upstream stream chunk by chunk, watching for the client going away."""

    def __init__(
        self,
        opened: Opened,
        headers: Mapping[str, str],
        on_done: Callable[[StreamOutcome], None],
        error_event: Callable[[str], bytes],
        translation: Translation | None = None,
        end_marker: bytes | None = None,
        prefill: PrefillWatch | None = None,
    ) -> None:
        """``headers``: the response's (the rank's that are relayed, the proxy's own);
        ``error_event`` renders the event that ends a broken stream, in the client API's own shape;
        ``translation`` turns the rank's chunks into the client API's (None: relayed as they are);
        ``end_marker`` starts the SSE line of the stream's last event: the outcome is reported before
        the chunk holding it is sent, so a client that asks again at once finds this answer counted.
        It is matched only at a line's start, where no event's text can put it (JSON escapes
        newlines). ``prefill``: fed the chunks after the first until it says the rank's prefill is
        done (a stream whose first chunk was its API's preamble: ``PrefillWatch``)."""
        self.opened = opened
        self.on_done = on_done
        self.error_event = error_event
        self.translation = translation
        self.status_code = opened.response.status
        self.background = None
        self.init_headers(headers)
        self._tail: deque[bytes] = deque(maxlen=STREAM_TAIL_CHUNKS)
        self._error: str | None = None
        self._completed = False
        self._first_byte_at = time.perf_counter()
        self._settled = False
        #: Why the server cut the stream (its request was cancelled), if it did.
        self._cut: str | None = None
        self._reported = False
        self._watcher: asyncio.Task[bool] | None = None
        self._end_line = None if end_marker is None else b"\n" + end_marker
        self.end_marker = end_marker
        self._prefill = prefill

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # The relay runs in the request's own task, which the watcher cancels when the client leaves
        # (one task a stream, no asyncio.wait: proxy/stages/disconnect.py).
        current = asyncio.current_task()
        assert current is not None, "a response is sent from a task"
        self._watcher = watcher = asyncio.ensure_future(cancel_on_disconnect(receive, current))
        try:
            await self._relay(send)
        except asyncio.CancelledError:
            if not fired(watcher):
                raise  # the server ended the request (shutdown): the relay sent the cut's event
            current.uncancel()  # the client left: nothing more to send
        else:
            if fired(watcher):  # it left as the stream ended, and the relay finished anyway
                current.uncancel()
        finally:
            watcher.cancel()
            self._settle()  # a relay cancelled before it started never ran its own cleanup

    async def _relay(self, send: Send) -> None:
        opened = self.opened
        rank = opened.rank
        tail = self._tail
        translate = self.translation
        self._first_byte_at = time.perf_counter()
        try:
            await send(
                {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            )
            first = opened.first_chunk
            ends = self._ends
            if first:
                tail.append(first)
                if ends(first):
                    self._report(left=False)
                out = translate.chunk(first) if translate is not None else first
                await send({"type": "http.response.body", "body": out, "more_body": True})
            assert opened.chunks is not None
            try:
                checker = opened.checker
                async for chunk in opened.chunks:
                    problem = checker.feed(chunk) if checker is not None else None
                    if problem is not None:  # end the stream here rather than relay what clients cannot parse
                        raise MalformedStream(problem)
                    tail.append(chunk)
                    if self._prefill is not None and self._prefill.feed(chunk):
                        self._prefill = None
                    if not self._reported and ends(chunk):
                        self._report(left=False)
                    out = translate.chunk(chunk) if translate is not None else chunk
                    await send({"type": "http.response.body", "body": out, "more_body": True})
            except (aiohttp.ClientError, TimeoutError, MalformedStream) as exc:
                error = f"{rank.name} broke mid-stream: {type(exc).__name__}"
                if isinstance(exc, MalformedStream):
                    error = f"{rank.name} sent a {exc}"
                self._error = error
                log.warning("%s", error)
                await send({"type": "http.response.body", "body": self.error_event(error), "more_body": True})
            end = translate.end() if translate is not None else b""
            await send({"type": "http.response.body", "body": end, "more_body": False})
            self._completed = True
        except asyncio.CancelledError:
            if not fired(self._watcher):
                # not the client leaving (the watcher's): the server ended the request, which at
                # shutdown means the stream outlived --shutdown-timeout
                self._cut = cut = "prefixgate is shutting down: the stream was cut at its shutdown timeout"
                self._error = cut
                log.warning("%s: %s", rank.name, cut)
                with contextlib.suppress(Exception):  # best effort: the connection may be gone
                    await send(
                        {"type": "http.response.body", "body": self.error_event(cut), "more_body": False}
                    )
            raise
        finally:
            self._settle()

    def _ends(self, chunk: bytes) -> bool:
        """Whether ``chunk`` holds the stream's last event (the end marker at a line's start)."""
        marker, line = self.end_marker, self._end_line
        return marker is not None and line is not None and (chunk.startswith(marker) or line in chunk)

    def _settle(self) -> None:
        """Release the rank and report the outcome (unless the last event did already), once."""
        if self._settled:
            return
        self._settled = True
        # the connection is reused only after a whole stream; else its state is unknown
        self.opened.close(reusable=self._completed and self._error is None)
        self._report(left=not self._completed and self._cut is None)  # a cut stream is an error

    def _report(self, *, left: bool) -> None:
        """Tell ``on_done`` how the stream ended (``left``: the client went away first), once."""
        if self._reported:
            return
        self._reported = True
        opened = self.opened
        self.on_done(
            StreamOutcome(opened.first_chunk, tuple(self._tail), self._error, left, self._first_byte_at)
        )


# -- the rank's stream, read -----------------------------------------------------------------------

#: Watchdog wake-ups per read timeout: a stall is caught within this fraction past the timeout.
CHECKS_PER_TIMEOUT = 4


class RankStream:
    """The rest of ``response``'s body as an async iterator of chunks; ``close`` stops its watchdog.

    aiohttp enforces ``sock_read`` (the longest gap between bytes from a rank) by re-arming a timer
    on every read: a ``TimerHandle`` made, pushed on the loop's heap and cancelled for every streamed
    token. Without it, two proxies side by side on one-line requests streaming 64 chunks spent 8.18
    against 9.03 ms of CPU per request (~14 us a chunk, 8 alternating rounds). A stream instead gets
    one timer that wakes every quarter of the read timeout, and ends the stream
    (``SocketTimeoutError``, as aiohttp's own timeout) when no byte arrived while the relay was
    waiting for one through a whole read timeout. A stall is caught after 1 to 1.25 read timeouts,
    and a relay held up by a slow client (not waiting) is never a stalled rank, as aiohttp's paused
    reading is not.

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


# -- its events, checked --------------------------------------------------------------------------

#: Longest line accepted without a newline; a rank streaming more without one is broken.
MAX_PENDING_BYTES = 8 * 1024 * 1024
DONE = b"[DONE]"


class SseChecker:
    """Checks that a rank's SSE stream is well-formed while it is relayed: feed it the stream's
    chunks in order; ``feed`` returns a description of the first defect.

    A rank that emits an undecodable ``data:`` event would hand the client garbage its SDK cannot
    parse; prefixgate stops the stream at the first such event instead (with an SSE error event), or
    retries on another rank when the bad event is in the first chunk, before anything was sent.

    Only complete lines are checked: a chunk boundary may fall anywhere, so the unterminated tail of
    a chunk waits for the next one. Each event's data is validated once, the only way to tell a
    truncated JSON object from a whole one: by msgspec into a ``Raw`` (its syntax is checked, no
    Python object is built: 0.18 us for a token's event where orjson's parse took 0.6 us), plus its
    UTF-8. A chunk that is one whole single-line event (a streamed token's, nearly every chunk) is
    checked without being split into lines. Measured in place (two proxies side by side, one-line
    requests streaming 64 chunks, 16 alternating rounds): 8.30 against 8.95 ms of CPU per request,
    ~10 us a chunk of the ~100.
    """

    __slots__ = ("_data", "_pending")

    def __init__(self) -> None:
        self._pending = b""
        self._data: list[bytes] = []  # data lines of the event being read

    def feed(self, chunk: bytes) -> str | None:
        """None while the stream is well-formed, else what is wrong with it."""
        if (
            not self._pending
            and chunk.startswith(b"data: {")
            and chunk.endswith(b"\n\n")
            and chunk.find(b"\n", 7) == len(chunk) - 2
            and not self._data
        ):
            return _malformed(chunk[6:-2])
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n")
        if end < 0:
            self._pending = data
            if len(data) > MAX_PENDING_BYTES:
                return f"a line longer than {MAX_PENDING_BYTES} bytes"
            return None
        self._pending = data[end + 1 :]
        for line in data[:end].split(b"\n"):
            line = line.rstrip(b"\r")
            if not line:  # a blank line ends the event
                if self._data:
                    problem = self._check_event()
                    if problem is not None:
                        return problem
                continue
            if line.startswith(b"data:"):
                self._data.append(line[5:].lstrip(b" "))
        return None

    def _check_event(self) -> str | None:
        parts, self._data = self._data, []
        payload = parts[0] if len(parts) == 1 else b"\n".join(parts)
        return None if payload == DONE else _malformed(payload)


_VALIDATOR = msgspec.json.Decoder(msgspec.Raw)


def _malformed(payload: bytes) -> str | None:
    """What is wrong with an event's data (one JSON value, in UTF-8), or None."""
    try:
        _VALIDATOR.decode(payload)
        payload.decode()  # msgspec leaves the bytes inside strings unchecked
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        # where, not what: the event is completion text, which logs and clients must not get
        return f"malformed SSE event: {len(payload)} bytes of data, {exc}"
    return None


# -- its prefill's end ----------------------------------------------------------------------------

EVENT = b"event:"


def past_preamble(chunk: bytes, preamble: frozenset[bytes]) -> bool:
    """Whether ``chunk`` names an SSE event outside ``preamble`` (every chunk is, for an empty one).

    A chunk cut inside an ``event:`` line names a partial event, which is outside: a cut only ever
    comes after the preamble's events (each is one line) or inside the output that follows them.
    """
    if not preamble:
        return True
    at = chunk.find(EVENT)
    while at >= 0:
        if at == 0 or chunk[at - 1] == 0x0A:  # at a line's start: the event's name
            end = chunk.find(b"\n", at)
            if chunk[at + len(EVENT) : end if end >= 0 else len(chunk)].strip() not in preamble:
                return True
        at = chunk.find(EVENT, at + len(EVENT))
    return False


class PrefillWatch:
    """Calls ``then`` once, at the first chunk past ``preamble``; the relay feeds it until then.

    A stream's prefill is done at its first chunk, unless its API opens with a preamble: vLLM's
    Responses stream sends ``response.created`` and ``response.in_progress`` before it awaits the
    engine's first output (``Api.stream_preamble``); its prefill is done at the first chunk naming
    another event. Chat and Messages streams (their ``message_start`` included) send their first
    chunk after the prefill. The router takes a request's prefill off its rank's queue at that
    moment (the ``prefilled`` event), so a preamble taken for the first token would count the
    prefill done too soon.
    """

    def __init__(self, preamble: frozenset[bytes], then: Callable[[], None]) -> None:
        self.preamble = preamble
        self.then = then

    def feed(self, chunk: bytes) -> bool:
        """True once ``then`` has been called (at this chunk): the relay stops feeding it."""
        if not past_preamble(chunk, self.preamble):
            return False
        self.then()
        return True
