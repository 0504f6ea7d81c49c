"""Stage 7, forward: send the request to the plan's ranks in turn until one answers.

A rank that refuses the connection, times out, answers 5xx or breaks before any byte reached the
client is retried on the plan's next healthy rank (``retries`` times). For a stream, the rank's first
chunk is awaited before the client's response starts: that is the only way to still retry, and it
costs the client nothing since its first byte could not come earlier. The answer (``Opened``) is
then relayed by ``proxy/stages/relay.py``.

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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping

import aiohttp

from proxy.context import RoutePlan
from proxy.errors import ProxyError, upstream_failed
from proxy.ops.metrics import Metrics
from proxy.stages.relay import Opened, RankStream, SseChecker
from proxy.unavailable import private
from routing.ranks import Rank

log = logging.getLogger("prefixgate.forward")

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
