"""The request pipeline, stage by stage (see docs/architecture.md):

parse -> identify session -> canonicalize -> render and hash blocks -> admit -> pick a rank ->
forward and stream -> observe usage -> update index and session stats.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from proxy.admission import Admission
from proxy.blocks import BlockStage
from proxy.canonicalize import DEBUG_HEADER, CanonStage, rewrites_header
from proxy.context import ApiKind, RequestContext
from proxy.errors import NO_BACKEND, ProxyError, error_response, sse_error_event
from proxy.explain import Explainer
from proxy.forward import (
    ClientDisconnected,
    Forwarder,
    Opened,
    RelayResponse,
    StreamOutcome,
    response_headers,
    until_disconnected,
    upstream_headers,
)
from proxy.limits import DEFAULT_BOUNDS, Bounds
from proxy.metrics import Metrics
from proxy.observe import Usage, json_or_none, last_event_with, record_usage, usage_of_json
from proxy.parse import parse_request, read_body
from proxy.session_id import identify_session

log = logging.getLogger("prefixgate.pipeline")

#: Status logged (and counted) for a request whose client went away: nginx's convention.
CLIENT_CLOSED = 499


class Pipeline:
    def __init__(
        self,
        forwarder: Forwarder,
        metrics: Metrics,
        max_body_bytes: int,
        blocks: BlockStage | None = None,
        bounds: Bounds = DEFAULT_BOUNDS,
        canon: CanonStage | None = None,
        debug_headers: bool = False,
        explainer: Explainer | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.admission = admission
        self.explainer = explainer
        self.canon = canon
        self.debug_headers = debug_headers
        self.blocks = blocks or BlockStage(None)
        self.bounds = bounds
        self.forwarder = forwarder
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def completion(self, request: Request, api: ApiKind) -> Response:
        """``POST /v1/chat/completions`` and ``POST /v1/completions``."""
        endpoint = api.upstream_path
        started = time.perf_counter()
        ctx: RequestContext | None = None
        try:
            ctx = await parse_request(request, api, self.max_body_bytes, self.bounds)
            identify_session(ctx)
            if self.canon is not None:
                self.canon(ctx)
            await self.blocks(ctx)
            opened = await self.admit_and_open(request, ctx, endpoint, ctx.upstream_body(), self.forwarder)
        except ProxyError as exc:
            return self._error(endpoint, exc, started)
        except ClientDisconnected:
            return self._client_gone(endpoint, ctx, started)
        return self.answer(ctx, opened, endpoint, started)

    async def passthrough(self, request: Request, path: str) -> Response:
        """``POST /tokenize`` and ``/detokenize``: the body goes to one healthy rank as it is."""
        started = time.perf_counter()
        try:
            raw = await read_body(request, self.max_body_bytes)
            opened = await until_disconnected(
                request.receive,
                self.forwarder.open(None, path, raw, upstream_headers(request.headers), stream=False),
            )
        except ProxyError as exc:
            return self._error(path, exc, started)
        except ClientDisconnected:
            return self._client_gone(path, None, started)
        return self.relay_whole(path, opened, started)

    # -- admit, forward, answer, observe (shared with proxy/agent_pipeline.py) ----------------------

    async def admit_and_open(
        self, request: Request, ctx: RequestContext, endpoint: str, content: bytes, forwarder: Forwarder
    ) -> Opened:
        """Admit the request's session, then open ``content`` at ``endpoint`` through ``forwarder``
        (raises ``ClientDisconnected`` when the client goes away first)."""
        if self.admission is not None:
            await self.admission.admit(ctx, request.receive)
        return await until_disconnected(
            request.receive,
            forwarder.open(ctx, endpoint, content, upstream_headers(request.headers), stream=ctx.stream),
        )

    def answer(
        self,
        ctx: RequestContext,
        opened: Opened,
        endpoint: str,
        started: float,
        read_usage: Callable[[Any], Usage | None] = usage_of_json,
        error_event: Callable[[str], bytes] = sse_error_event,
        on_stream_end: Callable[[StreamOutcome], None] | None = None,
        on_body: Callable[[Any], None] | None = None,
    ) -> Response:
        """The client's response for a routed request: the stream relayed, or the whole answer; usage
        (parsed by ``read_usage``) is observed when it ends. ``on_stream_end(outcome)`` runs before a
        finished stream's usage is observed, ``on_body(parsed JSON or None)`` after a 200 answer's."""
        backend = opened.backend.name
        if self.explainer is not None:
            self.explainer.after_route(ctx)
        session_headers = self.session_headers(ctx)
        if opened.chunks is not None:

            def finish(outcome: StreamOutcome) -> None:
                if self.stream_ended(endpoint, backend, outcome, started):
                    if on_stream_end is not None:
                        on_stream_end(outcome)
                    self.observe(ctx, backend, last_event_with(outcome.tail, b'"usage"', read_usage))

            relay = RelayResponse(opened, finish, error_event)
            relay.headers.update(session_headers)
            return relay

        status = opened.response.status
        assert opened.body is not None
        if status == 200:
            data = json_or_none(opened.body)  # parsed once, for the usage and for ``on_body``
            self.observe(ctx, backend, read_usage(data) if data is not None else None)
            if on_body is not None:
                on_body(data)
        headers = response_headers(opened.response, backend)
        headers.update(session_headers)
        self.answered(endpoint, backend, status, started)
        return Response(opened.body, status_code=status, headers=headers)

    def session_headers(self, ctx: RequestContext) -> dict[str, str]:
        """The ``x-prefixgate-*`` headers telling the client its session and expected hits."""
        headers = {"x-prefixgate-session": ctx.session_key} if ctx.session_key else {}
        if ctx.estimated_cached_tokens is not None:
            headers["x-prefixgate-estimated-cached-tokens"] = str(ctx.estimated_cached_tokens)
        if self.debug_headers:
            headers[DEBUG_HEADER] = rewrites_header(ctx.rewrites or {})
        return headers

    def observe(self, ctx: RequestContext, backend: str, usage: Usage | None) -> None:
        """Feed a finished request's usage to the metrics, admission, the explainer and the router."""
        record_usage(self.metrics, backend, usage)
        if self.admission is not None:
            self.admission.observed(ctx, backend, usage)
        if self.explainer is not None:
            if usage is not None:
                self.explainer.after_observe(ctx, usage.cached_tokens, usage.prompt_tokens)
            else:
                self.explainer.after_observe(ctx, None)
        if ctx.backend is not None:
            self.forwarder.router.observe(
                ctx, ctx.backend, usage.cached_tokens if usage is not None else None
            )

    def answered(self, endpoint: str, backend: str, status: int, started: float) -> None:
        """Count a whole (non-streamed) answer: its time to first byte equals its duration."""
        elapsed = time.perf_counter() - started
        self.metrics.ttfb.labels(endpoint).observe(elapsed)
        self.metrics.duration.labels(endpoint).observe(elapsed)
        self.metrics.requests.labels(endpoint, backend, str(status)).inc()

    def relay_whole(self, endpoint: str, opened: Opened, started: float) -> Response:
        """Count and return an upstream answer as it came (no usage observed, no session headers)."""
        backend = opened.backend.name
        status = opened.response.status
        self.count_relayed(endpoint, backend, status, started)
        assert opened.body is not None
        return Response(opened.body, status_code=status, headers=response_headers(opened.response, backend))

    def count_relayed(self, endpoint: str, backend: str, status: int, started: float) -> None:
        """Count an upstream answer relayed as it came."""
        self.metrics.requests.labels(endpoint, backend, str(status)).inc()
        self.metrics.duration.labels(endpoint).observe(time.perf_counter() - started)

    def stream_ended(self, endpoint: str, backend: str, outcome: StreamOutcome, started: float) -> bool:
        """Count a relayed stream's end; False when the client went away (nothing to observe then)."""
        now = time.perf_counter()
        self.metrics.ttfb.labels(endpoint).observe(outcome.first_byte_at - started)
        self.metrics.duration.labels(endpoint).observe(now - started)
        if outcome.disconnected:
            self.metrics.client_disconnects.labels(endpoint).inc()
            self.metrics.requests.labels(endpoint, backend, str(CLIENT_CLOSED)).inc()
            return False
        if outcome.error is not None:
            self.metrics.stream_errors.labels(backend).inc()
        self.metrics.requests.labels(endpoint, backend, "200").inc()
        return True

    def count_error(self, endpoint: str, exc: ProxyError, started: float) -> None:
        """Count a request that failed before reaching a rank."""
        self.metrics.requests.labels(endpoint, NO_BACKEND, str(exc.status)).inc()
        self.metrics.duration.labels(endpoint).observe(time.perf_counter() - started)

    def client_closed(self, endpoint: str, ctx: RequestContext | None) -> Response:
        """Count a client that went away before its answer started, and the 499 logged for it."""
        self.metrics.client_disconnects.labels(endpoint).inc()
        backend = ctx.backend.name if ctx is not None and ctx.backend is not None else NO_BACKEND
        self.metrics.requests.labels(endpoint, backend, str(CLIENT_CLOSED)).inc()
        return Response(status_code=CLIENT_CLOSED, headers={"x-prefixgate-backend": backend})

    def _error(self, endpoint: str, exc: ProxyError, started: float) -> Response:
        self.count_error(endpoint, exc, started)
        return error_response(exc)

    def _client_gone(self, endpoint: str, ctx: RequestContext | None, started: float) -> Response:
        response = self.client_closed(endpoint, ctx)
        log.info("client went away before %s completed", endpoint)
        return response
