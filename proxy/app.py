"""The HTTP surface: every registered API (``proxy/apis``) in front of the configured ranks, plus the
operator's endpoints (health, metrics, admin, dashboard)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response

from proxy.apis import APIS, CHAT
from proxy.apis.base import Api, Endpoint
from proxy.config import Settings
from proxy.endpoints import LeanApp, Routes, Wrapper, internal_error
from proxy.errors import ProxyError, error_response
from proxy.gateway import Gateway
from proxy.ops.admin import admin_router
from proxy.ops.auth import install as install_auth
from proxy.ops.bodylog import BodyLogMiddleware
from proxy.ops.dashboard.api import login_page
from proxy.ops.gauges import export_gauges
from proxy.ops.limits import HeaderLimitMiddleware
from proxy.ops.models import Models, json_response
from proxy.path_hints import missing_prefix_hint
from proxy.pipeline import Pipeline
from proxy.server import ServingOptions

log = logging.getLogger("prefixgate")

Handler = Callable[..., Awaitable[Response]]


def create_app(settings: Settings) -> LeanApp:
    """The ASGI app for ``settings``; the gateway starts and stops with the app's lifespan."""
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: LeanApp) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = LeanApp(title="prefixgate", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.gateway = gateway
    app.state.serving = ServingOptions.from_settings(settings)  # how proxy/server.py serves it

    def current() -> Gateway:
        assert gateway.pipeline is not None, "the app's lifespan has not started"
        return gateway

    def pipeline() -> Pipeline:
        pipe = current().pipeline
        assert pipe is not None
        return pipe

    app.include_router(admin_router(current, gateway.dashboard.recorder.turns.as_json))
    app.include_router(gateway.dashboard.router(current))
    # header bound, then auth, then (optional) body logging: on the framework's stack and, the same
    # in the same order, on the lean path (proxy/endpoints.py); middleware added last runs first
    app.state.keys, auth = install_auth(settings, gateway.metrics, login_page)
    lean: list[Wrapper] = [lambda inner: HeaderLimitMiddleware(inner, settings.max_header_bytes), auth]
    if settings.log_bodies:
        lean.append(BodyLogMiddleware)
    for wrap in reversed(lean):
        app.add_middleware(wrap)

    # The APIs' endpoints as plain Starlette routes (FastAPI's route machinery, dependency solving
    # and its exit stack, costs ~45 us a request and these handlers take the bare request); those
    # with a fixed path are served on the lean path, before the framework's stack.
    routes = Routes()
    for api in APIS:
        for endpoint in api.endpoints:
            handler = _handler(pipeline, api, endpoint)
            app.add_route(endpoint.path, handler, methods=[endpoint.method])
            if "{" not in endpoint.path:
                routes.add(endpoint.method, endpoint.path, handler)
    app.serve_lean(routes, lean)

    models = Models(gateway.fleet, settings.models_cache_ttl, settings.health_timeout)

    @app.get("/v1/models")
    async def list_models() -> Response:
        client = current().client
        assert client is not None
        return await models(client)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await pipeline().passthrough(request, "/tokenize", CHAT)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await pipeline().passthrough(request, "/detokenize", CHAT)

    @app.get("/health")
    async def health(request: Request) -> Response:
        """Liveness: 200 while the process serves, whatever the ranks' state (the body tells it)."""
        ranks = [r.status() for r in gateway.fleet]
        if not (request.scope.get("state") or {}).get("is_admin"):
            # open to anyone: where the ranks are (their URLs, in their errors too) stays private
            ranks = [{k: v for k, v in r.items() if k not in ("url", "last_error")} for r in ranks]
        healthy = sum(1 for r in gateway.fleet if r.healthy)
        status = "ok" if healthy else "no_healthy_backend"
        return json_response({"status": status, "healthy_backends": healthy, "backends": ranks})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        """Readiness: 503 until at least one rank is healthy (a load balancer sends nothing here
        that could only be answered 503); then 200, ``ready`` once every healthy rank's facts are
        known, else ``degraded`` with each rank's missing facts (``Gateway.degraded``).

        Degraded is 200, not 503: such a replica routes every request correctly, only less well (no
        pool size: no admission budget for that rank; the embedded tokenizer: approximate blocks),
        and it learns the rest by itself as the ranks answer. Some gaps last as long as the rank's
        setup does (a vLLM started without KV events never reports a source): a 503 would then take
        every replica out of the Service at once and serve nothing instead of serving degraded."""
        healthy = [r.name for r in gateway.fleet if r.healthy]
        if healthy and gateway.pipeline is not None:
            missing = gateway.degraded()
            if missing:
                return json_response({"status": "degraded", "healthy_backends": healthy, "missing": missing})
            return json_response({"status": "ready", "healthy_backends": healthy})
        admin = (request.scope.get("state") or {}).get("is_admin")
        # the ranks' errors name their addresses: the admin's to see, as in /health
        down = {r.name: r.last_error if admin else "down" for r in gateway.fleet}
        return json_response({"status": "not_ready", "healthy_backends": [], "down": down}, status=503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        gw = current()
        admin = bool((request.scope.get("state") or {}).get("is_admin"))  # per-session series: admin only
        rate = gw.dashboard.recorder.window.rate
        memory = (gw.locals.nbytes, gw.locals.budget_bytes)
        # the event lease exists only for event-fed ranks: without KV events there is nothing to hold
        writer = gw.router.index.event_writer_of() if gw.router and gw.settings.kv_events else None
        export_gauges(
            gw.metrics,
            gw.fleet,
            gw.admission,
            rate,
            gw.sessions,
            per_session=admin,
            session_memory=memory,
            backlog=gw.state.backlog(),
            dropped_saves=gw.state.dropped_saves(),
            event_writer_of=writer,
        )
        return Response(gw.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            path = request.url.path
            hint = missing_prefix_hint(app.routes, request.method, path, str(request.base_url))
            message = f"no such endpoint: {request.method} {path}{hint or ''}"
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
        return internal_error()

    return app


def _handler(pipeline: Callable[[], Pipeline], api: Api, endpoint: Endpoint) -> Handler:
    """The route handler running ``endpoint``'s action through the pipeline."""
    if endpoint.action == "retrieve":

        async def retrieve(request: Request) -> Response:
            stored_id = next(iter(request.path_params.values()))
            return await pipeline().retrieve(request, api, endpoint, stored_id)

        return retrieve
    if endpoint.action == "count":

        async def count(request: Request) -> Response:
            return await pipeline().count(request, api, endpoint)

        return count

    async def complete(request: Request) -> Response:
        return await pipeline().handle(request, api, endpoint)

    return complete
