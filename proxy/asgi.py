"""prefixgate's ASGI app: every request takes one path, the middleware then one router.

There is no framework stack. prefixgate had two paths: FastAPI's stack (server-error,
exception-telemetry, body-limit, exception and exit-stack middleware, then its router) and a lean
path beside it for the APIs' fixed-path endpoints. Side by side against ``prefixgate sim`` (proxy
CPU per streamed 16-token chat turn, 9 rounds of 600 turns, concurrency 8), FastAPI's stack for
every request cost 2.13 ms a turn where the pair cost 1.93. This one path costs what the pair did:
3.97 against 3.95 ms a 16-token turn and 12.0 against 11.75 ms a ~100k-token one, medians of 9
rounds (``python -m bench.http_path --rounds 9 --baseline-root DIR``, DIR a tree with the pair, at
``e3b0b3e``; the script has since been deleted, its finding is this paragraph).

Every request, the APIs' and the operator's alike, goes through the operator's middleware (header
bound, auth, body log) to one Starlette ``Router``, which tries the routes in the order they were
added (the APIs' first: they are the traffic). What the framework added that prefixgate needs is
here: the app's ``state``, its lifespan, and an HTTP error (404, 405) or an unexpected exception
(500) answered in the project's error shape.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager

from starlette.datastructures import State
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, Router
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.errors import ProxyError, error_response
from proxy.path_hints import missing_prefix_hint

log = logging.getLogger("prefixgate")

#: One middleware: wraps the app inside it.
Wrapper = Callable[[ASGIApp], ASGIApp]
Endpoint = Callable[[Request], object]


def internal_error() -> Response:
    return error_response(ProxyError(500, "internal error in prefixgate", type_="internal_error"))


class App:
    """The ASGI app: ``middleware`` (outermost first) around a router of the routes added."""

    def __init__(self, lifespan: Callable[[App], AbstractAsyncContextManager[None]]) -> None:
        self.state = State()
        self.router = Router(lifespan=lifespan)
        self._stack: ASGIApp = self._route

    @property
    def routes(self) -> list[BaseRoute]:
        return self.router.routes

    def add_route(self, path: str, endpoint: Endpoint, methods: Sequence[str] = ("GET",)) -> None:
        self.router.routes.append(Route(path, endpoint, methods=list(methods)))

    def add_routes(self, routes: Sequence[BaseRoute]) -> None:
        self.router.routes.extend(routes)

    def wrap(self, middleware: Sequence[Wrapper]) -> None:
        """Put ``middleware`` around the router, outermost first."""
        stack: ASGIApp = self._route
        for wrapper in reversed(middleware):
            stack = wrapper(stack)
        self._stack = stack

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self  # the router raises HTTPException (answered below) only inside an app
        if scope["type"] != "http":  # the lifespan
            await self.router(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await self._stack(scope, receive, tracked)
        except Exception:
            # the error shape when nothing was sent yet, and the exception on to the server, which
            # logs it and closes the connection
            log.exception("unexpected error on %s %s", scope["method"], scope["path"])
            if not started:
                await internal_error()(scope, receive, send)
            raise

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.router(scope, receive, send)
        except HTTPException as exc:
            await self._http_error(Request(scope), exc)(scope, receive, send)

    def _http_error(self, request: Request, exc: HTTPException) -> Response:
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            hint = missing_prefix_hint(self.routes, method, path, str(request.base_url))
            message = f"no such endpoint: {method} {path}{hint or ''}"
        elif exc.status_code == 405:
            message = f"method {method} is not allowed on {path}"
        else:
            message = str(exc.detail)
        return error_response(ProxyError(exc.status_code, message, code=f"http_{exc.status_code}"))
