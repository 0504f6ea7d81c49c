"""The request pipeline, for every API (``proxy/apis/``), stage by stage:

parse -> identify session -> its thread -> canonicalize -> render and hash blocks -> admit -> route ->
forward and stream -> the ending.

``handle`` below is that sequence; each stage is one object from ``proxy/stages/`` (admission from
``proxy/admission/``) that reads what the stages before it wrote on the request's context and
writes its own part.

The ending is told here too, in one place (``# -- the ending``), by explicit calls in order, to what
learns from answers: the router and its prefix index, admission and the session table, the threads,
the prefix-break explainer, the dashboard, the stored-answer pins and the token counts. Each call is
a step that may fail alone: it is logged, and the steps after it still run. The moments, in this order
for every routed request:

- placed: a rank holds the request (the plan's first choice once routed, and again the rank a retry
  landed on when that is another): admission seats the session there, the router moves its charge;
- prefilled: a stream's first token came (past its API's preamble: ``proxy/stages/forward.py``),
  never deferred by a landing: the router takes the prefill off the rank's queue;
- answered: the rank answered (its stream opened, or its whole body came): the explainer compares
  the turn with the session's previous one (after the router charged a turn routed on its head with
  its whole prompt, once that landed);
- ended: the request ended, answered, failed on every rank or left by its client (``_ended``).

A first turn routed on its head (``ctx.landing``) that is answered before its whole prompt has landed
is told ``answered`` and ``ended`` once it has: one await of its landing (``_after_landing``), so
that everything learns from the whole prompt.

The other entry points serve the APIs' side endpoints: token counting (canonicalized, any rank),
stored-answer retrieval (the rank that stored it) and the ranks' own ``/tokenize``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import ParamSpec
from urllib.parse import quote

import aiohttp
from starlette.requests import Request
from starlette.responses import Response

from proxy.admission import Admission
from proxy.apis.base import Api, Endpoint, Translation, json_or_none, last_event_with
from proxy.context import Outcome, RequestContext
from proxy.errors import CLIENT_CLOSED, NO_BACKEND, ProxyError, upstream_failed
from proxy.explain import Explainer
from proxy.ops.dashboard.stats import Recorder
from proxy.ops.metrics import Metrics
from proxy.stages.blocks import Blocks
from proxy.stages.canonicalize import DEBUG_HEADER, Canonicalize, rewrites_header, upstream_body
from proxy.stages.disconnect import ClientDisconnected, until_disconnected
from proxy.stages.forward import (
    Forwarder,
    Opened,
    PrefillWatch,
    RelayResponse,
    StreamOutcome,
    response_headers,
    upstream_headers,
)
from proxy.stages.identify import Identify, Threads
from proxy.stages.parse import Parse, read_body
from proxy.stages.route import Pins, Router
from proxy.tenants import client_view
from routing.ranks import Rank

log = logging.getLogger("prefixgate.pipeline")


class Pipeline:
    """The stages of one prefixgate process, called in order for each request."""

    def __init__(
        self,
        parse: Parse,
        identify: Identify,
        threads: Threads,
        canonicalize: Canonicalize,
        blocks: Blocks,
        admission: Admission,
        route: Router,
        forwarder: Forwarder,
        pins: Pins,
        explainer: Explainer,
        recorder: Recorder,
        metrics: Metrics,
        *,
        debug_headers: bool = False,
    ) -> None:
        self.parse = parse
        self.identify = identify
        self.threads = threads
        self.canonicalize = canonicalize
        self.blocks = blocks
        self.admission = admission
        self.route = route
        self.forwarder = forwarder
        self.pins = pins
        self.explainer = explainer
        self.recorder = recorder
        self.metrics = metrics
        self.debug_headers = debug_headers
        #: The requests answered before their prompt landed, waiting for it to end them
        #: (``_after_landing``): the event loop keeps only weak references to tasks.
        self._after_landings: set[asyncio.Task[None]] = set()

    async def handle(self, request: Request, api: Api, endpoint: Endpoint) -> Response:
        """A completion request of ``api`` (``POST``), through every stage."""
        started = time.perf_counter()
        ctx: RequestContext | None = None
        try:
            ctx = await self.parse(request, api)
            self.identify(ctx)
            self.threads(ctx)
            self.canonicalize(ctx)
            await self.blocks(ctx)  # a long first turn: its head's blocks now, the rest lands beside
            ctx.admitted = await self.admission.admit(
                ctx, lambda wait: until_disconnected(request.receive, wait)
            )
            ctx.plan = await self.route(ctx)
            self._placed(ctx, ctx.plan.ranks[0])
            translation = api.translation()
            content = translation.request(ctx.body) if translation is not None else upstream_body(ctx)
            opened = await until_disconnected(
                request.receive,
                self.forwarder.open(
                    ctx.plan, endpoint.upstream, content, upstream_headers(request.headers), stream=ctx.stream
                ),
                Opened.close,
            )
        except ProxyError as exc:
            self._unanswered(ctx, exc.status, exc.message)
            return self._refused(api, endpoint.path, exc, started)
        except ClientDisconnected:
            self._unanswered(ctx, CLIENT_CLOSED, "the client went away")
            return self._client_gone(endpoint.path, ctx)
        try:
            await self.blocks.settle(ctx)  # a short tail, encoded while the rank worked: landed now
        except asyncio.CancelledError:  # the answer is dropped: release what it holds
            opened.close()
            self._finished(Outcome(ctx, opened.rank.name, CLIENT_CLOSED, error="cancelled"))
            self._count_gone(endpoint.path, opened.rank.name)
            raise
        try:
            return self._answer(ctx, opened, endpoint.path, started, translation)
        except Exception as exc:  # an open stream holds its rank's count and connection: release both
            if opened.chunks is not None and not opened.closed:
                opened.close()
                self._finished(Outcome(ctx, opened.rank.name, 500, error=f"{type(exc).__name__}"))
            raise

    async def count(self, request: Request, api: Api, endpoint: Endpoint) -> Response:
        """Token counting: the request as it would be sent (canonicalized) to any healthy rank;
        nothing is cached, so nothing is routed by prefix."""
        started = time.perf_counter()
        try:
            ctx = await self.parse(request, api)
            self.identify(ctx)
            self.threads(ctx)
            self.canonicalize(ctx)
            opened = await until_disconnected(
                request.receive,
                self.forwarder.open(
                    self.route.any(),
                    endpoint.upstream,
                    upstream_body(ctx),
                    upstream_headers(request.headers),
                    stream=False,
                ),
            )
        except ProxyError as exc:
            return self._refused(api, endpoint.path, exc, started)
        except ClientDisconnected:
            return self._client_gone(endpoint.path, None)
        return self._relay_whole(endpoint.path, opened, started)

    async def retrieve(self, request: Request, api: Api, endpoint: Endpoint, stored_id: str) -> Response:
        """A stored answer (``GET``), from the rank that stored it."""
        started = time.perf_counter()
        try:
            owner = (request.scope.get("state") or {}).get("client_label")
            rank = await self.pins.rank_of(stored_id, owner)  # a client retrieves its own answers only
            headers = upstream_headers(request.headers)
            headers.pop("content-type", None)
            url = f"{rank.url}{endpoint.upstream}/{quote(stored_id, safe='')}"
            try:
                async with self.forwarder.client.get(url, headers=headers) as upstream:
                    body = await upstream.read()
                    status = upstream.status
                    out_headers = response_headers(upstream, rank.name)
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise upstream_failed(f"{rank.name}: {type(exc).__name__}: {exc}") from None
        except ProxyError as exc:
            return self._refused(api, endpoint.path, exc, started)
        self._count_relayed(endpoint.path, rank.name, status, started)
        return Response(body, status_code=status, headers=out_headers)

    async def passthrough(self, request: Request, path: str, api: Api) -> Response:
        """``POST /tokenize`` and ``/detokenize``: the body goes to one healthy rank as it is."""
        started = time.perf_counter()
        try:
            raw = await read_body(request, self.parse.max_body_bytes)
            opened = await until_disconnected(
                request.receive,
                self.forwarder.open(
                    self.route.any(), path, raw, upstream_headers(request.headers), stream=False
                ),
            )
        except ProxyError as exc:
            return self._refused(api, path, exc, started)
        except ClientDisconnected:
            return self._client_gone(path, None)
        return self._relay_whole(path, opened, started)

    # -- forward and stream -----------------------------------------------------------------------

    def _answer(
        self,
        ctx: RequestContext,
        opened: Opened,
        endpoint: str,
        started: float,
        translation: Translation | None,
    ) -> Response:
        """The client's response for a routed request: the stream relayed, or the whole answer
        (translated into the client's API when the rank does not serve it); its ending is told when
        it ends."""
        rank = opened.rank
        ctx.rank, ctx.attempts = rank, opened.attempts
        plan = ctx.plan
        assert plan is not None
        if plan.charged != rank.name:  # a retry landed on another rank
            self._placed(ctx, rank)
        api = ctx.api
        prefill: PrefillWatch | None = None
        if opened.chunks is not None:
            # not deferred by a landing: the rank's prefill is done whatever our tokenizer does;
            # a stream opening with its API's preamble is prefilled at the first chunk past it
            preamble = api.stream_preamble if translation is None else frozenset()
            prefill = PrefillWatch(preamble, lambda: self._prefilled(ctx))
            if prefill.feed(opened.first_chunk):
                prefill = None
        self._answered(ctx)
        headers = response_headers(opened.response, rank.name)
        headers.update(self._session_headers(ctx))
        if opened.chunks is not None:

            def done(stream: StreamOutcome) -> None:
                self._count_stream(endpoint, rank.name, stream, started)
                if stream.disconnected:
                    outcome = Outcome(ctx, rank.name, CLIENT_CLOSED, error=stream.error)
                else:
                    chunks = (stream.first, *stream.tail)
                    usage = last_event_with(stream.tail, b'"usage"', api.usage)
                    stored = last_event_with(chunks, b'"response"', api.stored_id)
                    outcome = Outcome(ctx, rank.name, 200, usage, stored, stream.error)
                self._finished(outcome)

            return RelayResponse(opened, headers, done, api.sse_error, translation, api.stream_end, prefill)

        status = opened.response.status
        body = opened.body
        assert body is not None
        usage = stored = None
        if status == 200:
            data = json_or_none(body)  # parsed once, for the usage and the stored id
            if data is not None:
                usage, stored = api.usage(data), api.stored_id(data)
            if translation is not None:
                body = translation.body(body)
        self._finished(Outcome(ctx, rank.name, status, usage, stored))
        self._count_whole(endpoint, rank.name, status, started)
        return Response(body, status_code=status, headers=headers)

    def _session_headers(self, ctx: RequestContext) -> dict[str, str]:
        """The ``x-prefixgate-*`` headers telling the client its session and expected hits."""
        key = ctx.session_key
        headers = {"x-prefixgate-session": client_view(key, ctx.client_label)} if key else {}
        estimated = ctx.estimated_cached_tokens
        if estimated is None and ctx.prompt_tokens is not None:
            estimated = 0  # the prompt was rendered, but is under one block: nothing of it can hit
        if estimated is not None:
            headers["x-prefixgate-estimated-cached-tokens"] = str(estimated)
            headers["x-prefixgate-estimated-cpu-tokens"] = str(ctx.estimated_cpu_tokens or 0)
        if self.debug_headers:
            headers[DEBUG_HEADER] = rewrites_header(ctx.rewrites or {})
        return headers

    # -- the ending -------------------------------------------------------------------------------

    def _placed(self, ctx: RequestContext, rank: Rank) -> None:
        """``rank`` holds the request now: admission seats its session there (its reservation becomes
        the session's place), then the router moves its charge there when a retry landed elsewhere."""
        safely(self.admission.placed, ctx, rank)
        safely(self.route.placed, ctx, rank)

    def _prefilled(self, ctx: RequestContext) -> None:
        """The rank's prefill of ``ctx`` is done: its stream's first token came, or a request still
        landing ended (told both, the router acts on the first)."""
        safely(self.route.prefilled, ctx)

    def _answered(self, ctx: RequestContext) -> None:
        """The rank ``ctx.rank`` answered: the explainer compares the turn with the session's previous
        one. A turn routed on its head whose prompt has landed is charged whole first (at once: the
        answer's headers carry what landing changed); one still landing, once it has landed."""
        landing = ctx.landing
        if landing is None:
            safely(self.explainer.routed, ctx)
        elif landing.done():
            self._landed(ctx)
        else:
            ctx.ending = asyncio.get_running_loop().create_future()
            self._after_landings.add(asyncio.create_task(self._after_landing(ctx, landing, ctx.ending)))

    def _landed(self, ctx: RequestContext) -> None:
        """The whole prompt of a turn routed on its head is on ``ctx``: the router charges it whole, then
        the explainer compares it."""
        safely(self.route.landed, ctx)
        safely(self.explainer.routed, ctx)

    async def _after_landing(
        self, ctx: RequestContext, landing: asyncio.Task[None], ending: asyncio.Future[Outcome]
    ) -> None:
        """A request answered before its whole prompt landed: once it has, what learns from answers is
        told it was answered, then how it ended (``_finished`` hands the outcome over)."""
        try:
            # never raises (``Blocks._rest``); shielded: the thread's next turn awaits it too
            await asyncio.shield(landing)
            self._landed(ctx)
            self._ended(await ending)
        finally:
            current = asyncio.current_task()
            if current is not None:
                self._after_landings.discard(current)

    def _unanswered(self, ctx: RequestContext | None, status: int, error: str) -> None:
        """An admitted request that no rank answered (routed or not): what learns from answers
        releases what it holds for it."""
        if ctx is not None and (ctx.plan is not None or ctx.admitted is not None):
            self._finished(Outcome(ctx, None, status, error=error))

    def _finished(self, outcome: Outcome) -> None:
        """The request ended. One answered before its whole prompt landed ends once it has (after its
        ``_answered``); its prefill is no longer queued at the rank from now, whatever our tokenizer
        does: told at once, or a wave of first turns answered whole kept its prefill queued for seconds
        after the answers, until the last one's whole prompt was tokenized here (3.8M phantom tokens
        per rank on 128 first turns of 57k tokens), and routing and admission weighed ranks by it. One
        never answered ends at once: nothing its ending does reads the prompt it was landing."""
        ending = outcome.ctx.ending
        if ending is None:
            self._ended(outcome)
        elif not ending.done():
            self._prefilled(outcome.ctx)
            ending.set_result(outcome)

    def _ended(self, outcome: Outcome) -> None:
        """How the request ended, told in this order: the tokens the rank reported counted; the
        thread's counts and its answer kept for the next turn's estimate; admission's session record
        (settled, or undone for a failure); the dashboard's hit rates and turn log; the explainer's
        rank-side break; the router's charge released and its mirror corrected; the rank a stored
        answer lives on."""
        safely(self._count_usage, outcome)
        safely(self.threads.finished, outcome)
        safely(self.admission.finished, outcome)
        safely(self.recorder.finished, outcome)
        safely(self.explainer.finished, outcome)
        safely(self.route.finished, outcome)
        safely(self.pins.finished, outcome)

    # -- counting ---------------------------------------------------------------------------------

    def _count_usage(self, outcome: Outcome) -> None:
        """The tokens the rank reported (``prefixgate_{prompt,completion,cached}_tokens``)."""
        usage = outcome.usage
        if usage is None or outcome.rank is None:
            return
        metrics, rank = self.metrics, outcome.rank
        metrics.series(metrics.prompt_tokens, rank).inc(usage.prompt_tokens)
        metrics.series(metrics.completion_tokens, rank).inc(usage.completion_tokens)
        if usage.cached_tokens is not None:
            metrics.series(metrics.cached_tokens, rank).inc(usage.cached_tokens)

    def _relay_whole(self, endpoint: str, opened: Opened, started: float) -> Response:
        """Count and return an upstream answer as it came (no usage observed, no session headers)."""
        rank = opened.rank.name
        status = opened.response.status
        self._count_relayed(endpoint, rank, status, started)
        assert opened.body is not None
        return Response(opened.body, status_code=status, headers=response_headers(opened.response, rank))

    def _count_whole(self, endpoint: str, rank: str, status: int, started: float) -> None:
        """Count a whole (non-streamed) answer: its time to first byte equals its duration."""
        elapsed = time.perf_counter() - started
        metrics = self.metrics
        metrics.series(metrics.ttfb, endpoint).observe(elapsed)
        metrics.series(metrics.duration, endpoint).observe(elapsed)
        metrics.series(metrics.requests, endpoint, rank, str(status)).inc()
        metrics.traffic.add(status, elapsed if status == 200 else None)

    def _count_relayed(self, endpoint: str, rank: str, status: int, started: float) -> None:
        metrics = self.metrics
        metrics.series(metrics.requests, endpoint, rank, str(status)).inc()
        metrics.series(metrics.duration, endpoint).observe(time.perf_counter() - started)
        metrics.traffic.add(status)

    def _count_stream(self, endpoint: str, rank: str, stream: StreamOutcome, started: float) -> None:
        metrics = self.metrics
        first_byte = stream.first_byte_at - started
        metrics.series(metrics.ttfb, endpoint).observe(first_byte)
        metrics.series(metrics.duration, endpoint).observe(time.perf_counter() - started)
        if stream.disconnected:
            metrics.series(metrics.client_disconnects, endpoint).inc()
            metrics.series(metrics.requests, endpoint, rank, str(CLIENT_CLOSED)).inc()
            metrics.traffic.add(CLIENT_CLOSED)
            return
        if stream.error is not None:
            metrics.series(metrics.stream_errors, rank).inc()
        metrics.series(metrics.requests, endpoint, rank, "200").inc()
        metrics.traffic.add(200, first_byte, broken=stream.error is not None)

    def _refused(self, api: Api, endpoint: str, exc: ProxyError, started: float) -> Response:
        """A request that failed before (or instead of) reaching a rank, in the API's error shape."""
        metrics = self.metrics
        metrics.series(metrics.requests, endpoint, NO_BACKEND, str(exc.status)).inc()
        metrics.series(metrics.duration, endpoint).observe(time.perf_counter() - started)
        metrics.traffic.add(exc.status)
        return api.error_response(exc, NO_BACKEND)

    def _client_gone(self, endpoint: str, ctx: RequestContext | None) -> Response:
        """Count a client that went away before its answer started, and the 499 logged for it."""
        rank = ctx.rank.name if ctx is not None and ctx.rank is not None else NO_BACKEND
        self._count_gone(endpoint, rank)
        return Response(status_code=CLIENT_CLOSED, headers={"x-prefixgate-backend": rank})

    def _count_gone(self, endpoint: str, rank: str) -> None:
        metrics = self.metrics
        metrics.series(metrics.client_disconnects, endpoint).inc()
        metrics.series(metrics.requests, endpoint, rank, str(CLIENT_CLOSED)).inc()
        metrics.traffic.add(CLIENT_CLOSED)
        log.info("client went away before %s completed", endpoint)


Step = ParamSpec("Step")


def safely(step: Callable[Step, object], *args: Step.args, **kwargs: Step.kwargs) -> None:
    """``step(*args, **kwargs)``, one step of a request's ending: when it fails, the failure is logged
    and the steps after it still run (a charge never released would weigh on its rank for good)."""
    try:
        step(*args, **kwargs)
    except Exception:
        log.exception("%s failed", getattr(step, "__qualname__", step))
