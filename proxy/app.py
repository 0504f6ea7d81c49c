"""The HTTP surface: every registered API (``proxy/apis``) in front of the configured ranks, plus the
operator's endpoints (health, metrics, admin, dashboard)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response

from proxy.apis import APIS, CHAT
from proxy.apis.base import Api, Endpoint
from proxy.asgi import App, Wrapper
from proxy.config import Settings
from proxy.gateway import Gateway
from proxy.ops.admin import admin_routes
from proxy.ops.auth import install as install_auth
from proxy.ops.bodylog import BodyLogMiddleware
from proxy.ops.dashboard.api import login_page
from proxy.ops.gauges import export_gauges
from proxy.ops.limits import HeaderLimitMiddleware
from proxy.ops.models import Models, json_response
from proxy.pipeline import Pipeline
from proxy.server import ServingOptions

log = logging.getLogger("prefixgate")

Handler = Callable[..., Awaitable[Response]]


def create_app(settings: Settings) -> App:
    """The ASGI app for ``settings``; the gateway starts and stops with the app's lifespan."""
    gateway = Gateway(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: App) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = App(lifespan)
    app.state.gateway = gateway
    app.state.serving = ServingOptions.from_settings(settings)  # how proxy/server.py serves it

    def current() -> Gateway:
        assert gateway.pipeline is not None, "the app's lifespan has not started"
        return gateway

    def pipeline() -> Pipeline:
        pipe = current().pipeline
        assert pipe is not None
        return pipe

    # header bound, then auth, then (optional) body logging, around every route
    app.state.keys, auth = install_auth(settings, gateway.metrics, login_page)
    middleware: list[Wrapper] = [lambda inner: HeaderLimitMiddleware(inner, settings.max_header_bytes), auth]
    if settings.log_bodies:
        middleware.append(BodyLogMiddleware)
    app.wrap(middleware)

    # The APIs' endpoints first: the router tries the routes in order, and they are the traffic.
    for api in APIS:
        for endpoint in api.endpoints:
            app.add_route(endpoint.path, _handler(pipeline, api, endpoint), methods=[endpoint.method])
    app.add_routes(admin_routes(current, gateway.dashboard.recorder.turns.as_json))
    app.add_routes(gateway.dashboard.routes(current))

    models = Models(gateway.fleet, settings.models_cache_ttl, settings.health_timeout)

    async def list_models(request: Request) -> Response:
        client = current().client
        assert client is not None
        return await models(client)

    async def tokenize(request: Request) -> Response:
        return await pipeline().passthrough(request, "/tokenize", CHAT)

    async def detokenize(request: Request) -> Response:
        return await pipeline().passthrough(request, "/detokenize", CHAT)

    async def health(request: Request) -> Response:
        """Liveness: 200 while the process serves, whatever the ranks' state (the body tells it)."""
        ranks = [r.status() for r in gateway.fleet]
        if not (request.scope.get("state") or {}).get("is_admin"):
            # open to anyone: where the ranks are (their URLs, in their errors too) stays private
            ranks = [{k: v for k, v in r.items() if k not in ("url", "last_error")} for r in ranks]
        healthy = sum(1 for r in gateway.fleet if r.healthy)
        status = "ok" if healthy else "no_healthy_backend"
        return json_response({"status": status, "healthy_backends": healthy, "backends": ranks})

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

    app.add_route("/v1/models", list_models)
    app.add_route("/tokenize", tokenize, methods=["POST"])
    app.add_route("/detokenize", detokenize, methods=["POST"])
    app.add_route("/health", health)
    app.add_route("/ready", ready)
    app.add_route("/metrics", metrics)
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
