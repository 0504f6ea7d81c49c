"""The pipeline for the agents' own APIs: Anthropic Messages and OpenAI Responses.

The stages are those of ``proxy/pipeline.py``, run over two views of one request: the session key
and canonicalization work on the client's body in its own API (canonicalization through the API's
chat-shaped view of system text, tools and messages, mapped back); the rest (blocks, admission,
routing, observation) works on the chat-completions body vLLM converts the request into
(``tokenization.agent_apis``), which becomes ``ctx.body`` once the upstream bytes are fixed. The
rank gets the client's request at the same path, re-serialized only when canonicalization changed
it, and its answer is relayed as it comes, in the API's own SSE events; errors take the API's shape.

Responses continuing a stored one (``previous_response_id``) and retrievals go to the rank that
stored it (``proxy.responses.ResponseRanks``), never elsewhere: a rank that is gone is an error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from proxy.agent_api import AgentApi
from proxy.anthropic import AnthropicApi
from proxy.context import ApiKind, RequestContext
from proxy.errors import NO_BACKEND, ProxyError, bad_request, upstream_failed
from proxy.forward import (
    ClientDisconnected,
    Forwarder,
    StreamOutcome,
    response_headers,
    until_disconnected,
    upstream_headers,
)
from proxy.observe import last_event_with
from proxy.parse import new_context, parse_json_object, read_body
from proxy.pipeline import Pipeline
from proxy.responses import ResponseRanks, ResponsesApi, make_response_ranks
from proxy.session_id import fingerprint, identify_session
from routing.ranks import Rank
from tokenization.agent_apis import ConversionError

log = logging.getLogger("prefixgate.agents")

MESSAGES_PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"
RESPONSES_PATH = "/v1/responses"


def rank_unavailable(response_id: str, backend: str, why: str) -> ProxyError:
    return ProxyError(
        503,
        f"response {response_id!r} is stored on rank {backend}, which is {why}; it cannot be continued "
        "or retrieved on another rank (start a new conversation, or resend the full input without "
        "previous_response_id)",
        type_="service_unavailable",
        code="response_rank_unavailable",
        param="previous_response_id",
    )


def response_not_found(response_id: str) -> ProxyError:
    return ProxyError(
        404,
        f"response {response_id!r} is not known to prefixgate and no healthy rank holds it",
        code="response_not_found",
        param="previous_response_id",
    )


class _PinnedRouter:
    """A router with one choice: the rank holding a stored response."""

    def __init__(self, backend: Rank, response_id: str) -> None:
        self.backend = backend
        self.response_id = response_id

    def pick(self, ctx: Any, tried: Any = ()) -> Rank:
        if self.backend.name in tried or not self.backend.healthy:
            raise rank_unavailable(self.response_id, self.backend.name, "down")
        return self.backend


class AgentPipeline:
    """Handlers for ``/v1/messages``, ``/v1/messages/count_tokens`` and ``/v1/responses[/{id}]``."""

    def __init__(self, pipeline: Pipeline, ranks: ResponseRanks, probe_timeout: float = 2.0) -> None:
        self.pipeline = pipeline
        self.forwarder = pipeline.forwarder
        self.metrics = pipeline.metrics
        self.ranks = ranks
        self.probe_timeout = probe_timeout
        self.anthropic = AnthropicApi()
        self.responses = ResponsesApi()

    @classmethod
    def from_settings(cls, pipeline: Pipeline, settings: Any) -> AgentPipeline:
        ranks = make_response_ranks(settings.redis_url, settings.redis_timeout)
        return cls(pipeline, ranks, settings.health_timeout)

    # -- POST ---------------------------------------------------------------------------------------
    async def handle(self, request: Request, api: AgentApi) -> Response:
        """``POST /v1/messages`` or ``POST /v1/responses``: the whole pipeline."""
        endpoint = api.kind.upstream_path
        started = time.perf_counter()
        ctx: RequestContext | None = None
        try:
            ctx = await self._parse(request, api, started)
            identify_session(ctx)
            self._canonicalize(ctx, api)
            upstream = ctx.upstream_body()  # fixed before ctx.body becomes the chat view
            try:
                chat = api.to_chat(ctx.body)
            except ConversionError as exc:
                raise bad_request(str(exc)) from None
            if ctx.session_key is None:
                key = fingerprint(chat)
                if key is not None:
                    ctx.session_key, ctx.session_source = key, "fingerprint"
            previous = _previous_id(ctx) if api.kind is ApiKind.RESPONSES else None
            ctx.body = chat  # from here on, the stages see the chat request the rank will render
            forwarder = self.forwarder
            if previous is not None:
                backend = await self._rank_of(previous)
                forwarder = Forwarder(
                    self.forwarder.client,
                    _PinnedRouter(backend, previous),  # type: ignore[arg-type]
                    self.metrics,
                    retries=0,
                )
            else:
                await self.pipeline.blocks(ctx)
            opened = await self.pipeline.admit_and_open(request, ctx, endpoint, upstream, forwarder)
        except ProxyError as exc:
            return self._error(api, endpoint, exc, started)
        except ClientDisconnected:
            return self.pipeline.client_closed(endpoint, ctx)

        on_stream_end = on_body = None
        if api.kind is ApiKind.RESPONSES:  # remember the rank that stores the response
            rank = opened.backend.name
            if opened.chunks is None:

                def on_body(data: Any) -> None:
                    self._remember(_response_id(data), rank)

            # the id is in response.created, usually the first chunk; else read it from the tail
            elif not self._remember_id((opened.first_chunk,), rank):

                def on_stream_end(outcome: StreamOutcome) -> None:
                    self._remember_id(outcome.tail, rank)

        return self.pipeline.answer(
            ctx, opened, endpoint, started, api.usage_from_json, api.sse_error, on_stream_end, on_body
        )

    async def count_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens``: any healthy rank counts the request as it would be sent
        (canonicalized); nothing is cached, so nothing is routed by prefix."""
        api = self.anthropic
        started = time.perf_counter()
        try:
            ctx = await self._parse(request, api, started)
            identify_session(ctx)
            self._canonicalize(ctx, api)
            opened = await until_disconnected(
                request.receive,
                self.forwarder.open(
                    None,
                    COUNT_TOKENS_PATH,
                    ctx.upstream_body(),
                    upstream_headers(request.headers),
                    stream=False,
                ),
            )
        except ProxyError as exc:
            return self._error(api, COUNT_TOKENS_PATH, exc, started)
        except ClientDisconnected:
            return self.pipeline.client_closed(COUNT_TOKENS_PATH, None)
        return self.pipeline.relay_whole(COUNT_TOKENS_PATH, opened, started)

    # -- GET /v1/responses/{id} ---------------------------------------------------------------------
    async def retrieve(self, request: Request, response_id: str) -> Response:
        """The stored response, from the rank that stored it."""
        endpoint = RESPONSES_PATH + "/{id}"
        started = time.perf_counter()
        try:
            backend = await self._rank_of(response_id)
            headers = upstream_headers(request.headers)
            headers.pop("content-type", None)
            url = f"{backend.url}{RESPONSES_PATH}/{quote(response_id, safe='')}"
            try:
                async with self.forwarder.client.get(url, headers=headers) as upstream:
                    body = await upstream.read()
                    status = upstream.status
                    out_headers = response_headers(upstream, backend.name)
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise upstream_failed(f"{backend.name}: {type(exc).__name__}: {exc}") from None
        except ProxyError as exc:
            return self._error(self.responses, endpoint, exc, started)
        self.pipeline.count_relayed(endpoint, backend.name, status, started)
        return Response(body, status_code=status, headers=out_headers)

    # -- stages -------------------------------------------------------------------------------------
    async def _parse(self, request: Request, api: AgentApi, started: float) -> RequestContext:
        raw = await read_body(request, self.pipeline.max_body_bytes)
        body = parse_json_object(raw)
        api.validate(body, self.pipeline.bounds)
        return new_context(request, api.kind, raw, body, bool(body.get("stream") or False), started)

    def _canonicalize(self, ctx: RequestContext, api: AgentApi) -> None:
        canon = self.pipeline.canon
        if canon is None or not canon.enabled_for(ctx):
            return
        try:
            view = api.canon_view(ctx.body)
        except ConversionError as exc:
            raise bad_request(str(exc)) from None
        canonical = canon.rewrite(ctx, view)
        if canonical is None:
            return
        ctx.body = api.from_canon_view(ctx.body, view, canonical)
        ctx.body_changed = True

    async def _rank_of(self, response_id: str) -> Rank:
        pool = self.forwarder.router.pool
        name = self.ranks.get(response_id)
        if name is None:
            name = await self._probe(response_id)
            if name is None:
                raise response_not_found(response_id)
            self.ranks.put(response_id, name)
        backend = pool.get(name)
        if backend is None:
            raise rank_unavailable(response_id, name, "no longer configured")
        if not backend.healthy:
            raise rank_unavailable(response_id, name, "down")
        return backend

    async def _probe(self, response_id: str) -> str | None:
        """The healthy rank that has ``response_id`` (for ids stored before this process knew them)."""
        timeout = aiohttp.ClientTimeout(total=self.probe_timeout)
        for backend in self.forwarder.router.pool.healthy():
            url = f"{backend.url}{RESPONSES_PATH}/{quote(response_id, safe='')}"
            try:
                async with self.forwarder.client.get(url, timeout=timeout) as response:
                    if response.status == 200:
                        return backend.name
            except (aiohttp.ClientError, TimeoutError):
                continue
        return None

    def _remember(self, response_id: str | None, backend: str) -> None:
        if response_id:
            self.ranks.put(response_id, backend)

    def _remember_id(self, chunks: Iterable[bytes], backend: str) -> bool:
        """Record the response id of the last event in ``chunks`` carrying one; whether there was one."""
        response_id = last_event_with(chunks, b'"response"', _event_response_id)
        self._remember(response_id, backend)
        return response_id is not None

    def _error(self, api: AgentApi, endpoint: str, exc: ProxyError, started: float) -> Response:
        self.pipeline.count_error(endpoint, exc, started)
        return api.error_response(exc, NO_BACKEND)


def _previous_id(ctx: RequestContext) -> str | None:
    previous = ctx.body.get("previous_response_id")
    return previous if isinstance(previous, str) and previous else None


def _response_id(data: Any) -> str | None:
    value = data.get("id") if isinstance(data, dict) else None
    return value if isinstance(value, str) else None


def _event_response_id(event: Any) -> str | None:
    response = event.get("response") if isinstance(event, dict) else None
    value = response.get("id") if isinstance(response, dict) else None
    return value if isinstance(value, str) else None


def install_routes(app: Any, gateway: Any) -> None:
    """Add the agent APIs' routes to prefixgate's app; the handlers start with the gateway."""
    agents: list[AgentPipeline] = []

    def handler() -> AgentPipeline:
        pipeline = gateway.pipeline
        assert pipeline is not None, "the app's lifespan has not started"
        if not agents or agents[0].pipeline is not pipeline:  # built once per gateway start
            agents[:] = [AgentPipeline.from_settings(pipeline, gateway.settings)]
        return agents[0]

    @app.post(MESSAGES_PATH)
    async def messages(request: Request) -> Response:
        agent = handler()
        return await agent.handle(request, agent.anthropic)

    @app.post(COUNT_TOKENS_PATH)
    async def count_tokens(request: Request) -> Response:
        return await handler().count_tokens(request)

    @app.post(RESPONSES_PATH)
    async def responses(request: Request) -> Response:
        agent = handler()
        return await agent.handle(request, agent.responses)

    @app.get(RESPONSES_PATH + "/{response_id}")
    async def retrieve(request: Request, response_id: str) -> Response:
        return await handler().retrieve(request, response_id)
