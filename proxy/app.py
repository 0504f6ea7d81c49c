"""The HTTP surface: an OpenAI-compatible API in front of the configured ranks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import httpx
import orjson
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from proxy.admin import admin_router
from proxy.admission import Admission, admission_from_settings
from proxy.agent_pipeline import install_routes as install_agent_routes
from proxy.auth import install as install_auth
from proxy.auth import upstream_auth_headers
from proxy.blocks import BlockStage
from proxy.bodylog import BodyLogMiddleware
from proxy.canonicalize import CanonStage
from proxy.config import Settings
from proxy.context import ApiKind
from proxy.dashboard import Dashboard
from proxy.errors import NO_BACKEND, ProxyError, error_response
from proxy.explain import Explainer
from proxy.forward import Forwarder, upstream_session
from proxy.limits import Bounds, HeaderLimitMiddleware
from proxy.metrics import Metrics
from proxy.pipeline import Pipeline
from proxy.route import Router
from proxy.routing_setup import build_router, start_kv_event_feeds
from proxy.sessions import SessionTable
from routing.health import check_all, run_health_checks
from routing.kv_events import KVEventSubscriber
from routing.policies import needs_of
from routing.ranks import Fleet, Rank
from tokenization.backend_info import block_size_of, parse_cache_config_info
from tokenization.config import TokenizerConfig
from tokenization.factory import build_incremental
from tokenization.prompt import IncrementalTokenizer

log = logging.getLogger("prefixgate")

JSON = "application/json"


def json_response(data: Any, status: int = 200, backend: str = NO_BACKEND) -> Response:
    return Response(
        orjson.dumps(data), status_code=status, media_type=JSON, headers={"x-prefixgate-backend": backend}
    )


class Gateway:
    """The state of one prefixgate process: backends, the HTTP client to them, the pipeline."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        # per-session prefix breaks: ``explainer.breaks(session_key)`` for the admin endpoints
        self.explainer = Explainer(self.metrics)
        # the session table (proxy/sessions.py): Redis when configured; ``add_break`` for the explainer
        self.sessions = SessionTable.from_settings(
            settings.redis_url, settings.session_idle_ttl, settings.redis_timeout
        )
        self.explainer.on_break = self.sessions.add_break
        # the live dashboard (proxy/dashboard): hit-rate series and turns per session
        self.dashboard = Dashboard(self.sessions.fleet)
        self.admission: Admission | None = None
        self.pool = Fleet(
            Rank(name=b.name, url=b.url, pool_tokens=b.pool_tokens, block_size=b.block_size)
            for b in settings.backends
        )
        self.router: Router | None = None
        self._kv_feeds: list[KVEventSubscriber] = []
        self.client: aiohttp.ClientSession | None = None
        self.forwarder: Forwarder | None = None
        self.pipeline: Pipeline | None = None
        self._health_task: asyncio.Task[None] | None = None
        self._tokenizer_client: httpx.AsyncClient | None = None
        self._models_cache: tuple[float, dict[str, Any], str] | None = None

    async def start(self) -> None:
        """Open the upstream client (it needs the running loop) and probe every rank once."""
        settings = self.settings
        self.client = upstream_session(
            settings.connect_timeout, settings.read_timeout, upstream_auth_headers(settings)
        )
        await check_all(self.client, self.pool, self.settings.health_timeout)
        await asyncio.gather(*(self._learn_cache_config(b) for b in self.pool if b.healthy))
        incremental = self._incremental_tokenizer()
        block_size = incremental.block_size if incremental is not None else self._block_size()
        model = await self._model_name()
        algo = incremental.hasher.algo if incremental is not None else "none"
        self.router = build_router(settings, self.pool, self.metrics, model, block_size or 16, algo)
        if settings.redis_url:  # name a wrong password or a TLS mismatch, not just "unreachable"
            from proxy.redis_check import log_redis_problem

            await asyncio.to_thread(log_redis_problem, settings.redis_url, max(settings.redis_timeout, 1.0))
        hasher = incremental.hasher if incremental is not None else None
        self._kv_feeds = await start_kv_event_feeds(settings, self.client, self.router, hasher, self.metrics)
        self.forwarder = Forwarder(self.client, self.router, self.metrics, settings.retries)
        self.admission = admission_from_settings(
            settings, self.sessions, self.pool, self.metrics, self.router.block_size
        )
        self.router.on_pick = self.admission.routed
        self.dashboard.attach(self.admission)
        self.pipeline = Pipeline(
            self.forwarder,
            self.metrics,
            settings.max_body_bytes,
            BlockStage(incremental),
            Bounds.from_settings(settings),
            CanonStage.from_settings(not settings.no_canonicalize, settings.canonical, self.metrics),
            settings.debug_headers,
            self.explainer,
            admission=self.admission,
        )
        self._health_task = asyncio.create_task(
            run_health_checks(
                self.client, self.pool, self.settings.health_interval, self.settings.health_timeout
            )
        )
        for backend in self.pool:
            state = "healthy" if backend.healthy else f"DOWN ({backend.last_error})"
            log.info("backend %s at %s: %s", backend.name, backend.url, state)

    async def _learn_cache_config(self, backend: Rank) -> None:
        """Block size and pool size from the rank's ``vllm:cache_config_info``, where not configured."""
        assert self.client is not None
        timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout)
        try:
            async with self.client.get(f"{backend.url}/metrics", timeout=timeout) as response:
                info = parse_cache_config_info((await response.read()).decode("utf-8", "replace"))
        except (aiohttp.ClientError, TimeoutError):
            return
        block_size = block_size_of(info)
        if backend.block_size is None and block_size is not None:
            backend.block_size = block_size
        blocks = info.get("num_gpu_blocks", "")
        if backend.pool_tokens is None and blocks.isdigit() and backend.block_size:
            backend.pool_tokens = int(blocks) * backend.block_size

    def _block_size(self) -> int | None:
        sizes = {b.block_size for b in self.pool if b.block_size}
        if len(sizes) > 1:
            log.warning("backends report different block sizes %s: using %d", sorted(sizes), min(sizes))
        return min(sizes) if sizes else None

    async def _model_name(self) -> str:
        """The served model's name (namespaces the shared index), from the first rank that says."""
        for backend in self.pool.healthy():
            cards = await self._fetch_models(backend)
            if cards and isinstance(cards[0], dict) and isinstance(cards[0].get("id"), str):
                return cards[0]["id"]
        return "default"

    def _incremental_tokenizer(self) -> IncrementalTokenizer | None:
        """The tokenizer of the blocks stage, when the routing policy uses prefix blocks."""
        if not needs_of(self.settings.policy).blocks:
            return None
        config = TokenizerConfig.model_validate(self.settings.tokenization)
        block_size = self._block_size()
        client = base_url = None
        if config.kind == "backend":
            self._tokenizer_client = client = httpx.AsyncClient(trust_env=False)
            base_url = next(iter(self.pool)).url
        return build_incremental(
            config,
            block_size=block_size,
            client=client,
            base_url=base_url,
        )

    async def stop(self) -> None:
        for feed in self._kv_feeds:
            feed.stop()
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        if self.client is not None:
            await self.client.close()
        if self._tokenizer_client is not None:
            await self._tokenizer_client.aclose()

    async def models(self) -> Response:
        """The union of the healthy ranks' model cards, first rank's card winning per id."""
        now = time.monotonic()
        cached = self._models_cache
        if cached is not None and now - cached[0] < self.settings.models_cache_ttl:
            return json_response(cached[1], backend=cached[2])
        backends = self.pool.healthy()
        if not backends:
            return error_response(ProxyError(503, "no healthy backend", type_="service_unavailable"))
        answers = await asyncio.gather(*(self._fetch_models(b) for b in backends))
        cards: dict[str, Any] = {}
        answered: list[str] = []
        for backend, data in zip(backends, answers, strict=True):
            if data is None:
                continue
            answered.append(backend.name)
            backend.models = [c["id"] for c in data if isinstance(c, dict) and "id" in c]
            for card in data:
                if isinstance(card, dict) and "id" in card:
                    cards.setdefault(card["id"], card)
        if not answered:
            return error_response(
                ProxyError(
                    502, "no backend answered /v1/models", type_="upstream_error", code="upstream_failed"
                )
            )
        body = {"object": "list", "data": list(cards.values())}
        names = ",".join(answered)
        self._models_cache = (now, body, names)
        return json_response(body, backend=names)

    async def _fetch_models(self, backend: Rank) -> list[Any] | None:
        assert self.client is not None
        timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout)
        try:
            async with self.client.get(f"{backend.url}/v1/models", timeout=timeout) as response:
                if response.status != 200:
                    return None
                data = orjson.loads(await response.read()).get("data")
        except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError, AttributeError):
            return None
        return data if isinstance(data, list) else None

    def health(self) -> Response:
        backends = [b.status() for b in self.pool]
        healthy = sum(1 for b in self.pool if b.healthy)
        body = {"status": "ok", "healthy_backends": healthy, "backends": backends}
        return json_response(body)

    def metrics_response(self) -> Response:
        if self.admission is not None:
            self.admission.refresh_metrics()
        for backend in self.pool:
            self.metrics.backend_up.labels(backend.name).set(1 if backend.healthy else 0)
            self.metrics.in_flight.labels(backend.name).set(backend.in_flight)
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def create_app(settings: Settings) -> FastAPI:
    """The ASGI app for ``settings``; the gateway starts and stops with the app's lifespan."""
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="prefixgate", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway

    def admission() -> Admission:
        assert gateway.admission is not None, "the app's lifespan has not started"
        return gateway.admission

    app.include_router(admin_router(admission))
    app.include_router(gateway.dashboard.router(lambda: gateway))
    # middleware added last runs first: header bound, then auth, then (optional) body logging
    if settings.log_bodies:
        app.add_middleware(BodyLogMiddleware)
    app.state.keys = install_auth(app, settings, gateway.metrics)
    app.add_middleware(HeaderLimitMiddleware, limit=settings.max_header_bytes)

    def pipeline() -> Pipeline:
        assert gateway.pipeline is not None, "the app's lifespan has not started"
        return gateway.pipeline

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await pipeline().completion(request, ApiKind.CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await pipeline().completion(request, ApiKind.COMPLETIONS)

    @app.get("/v1/models")
    async def models() -> Response:
        return await gateway.models()

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await pipeline().passthrough(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await pipeline().passthrough(request, "/detokenize")

    install_agent_routes(app, gateway)  # /v1/messages[/count_tokens], /v1/responses[/{id}]

    @app.get("/health")
    async def health() -> Response:
        return gateway.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return gateway.metrics_response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return error_response(ProxyError(exc.status_code, message, code=f"http_{exc.status_code}"))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(ProxyError(400, f"invalid request: {exc.errors()}"))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return error_response(ProxyError(500, "internal error in prefixgate", type_="internal_error"))

    return app
