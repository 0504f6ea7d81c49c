"""The APIs' endpoints served on a lean ASGI path, in front of the framework.

Every request to prefixgate went through FastAPI's whole stack (its server-error, telemetry, body
limit, exception and exit-stack middleware, then Starlette's router trying the admin and dashboard
routes before the APIs'): ~10 % of the proxy's CPU on a small request (py-spy, issue 22). The APIs'
endpoints with a fixed path (completions and token counts) are the traffic; ``LeanApp`` serves them
with only what they need (the header bound, authentication, the optional body log, a 500 in the
project's error shape for an unexpected exception) and hands every other request (the operator's
endpoints, retrieval by id, a wrong method, an unknown path) to the framework, unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from proxy.errors import ProxyError, error_response

log = logging.getLogger("prefixgate")

Handler = Callable[[Request], Awaitable[Response]]
#: The middleware a request of the lean path goes through, outermost first: each wraps the next.
Wrapper = Callable[[ASGIApp], ASGIApp]


def internal_error() -> Response:
    return error_response(ProxyError(500, "internal error in prefixgate", type_="internal_error"))


class Routes:
    """``(method, path)`` to the handler of an API endpoint with a fixed path."""

    def __init__(self) -> None:
        self.handlers: dict[tuple[str, str], Handler] = {}

    def add(self, method: str, path: str, handler: Handler) -> None:
        self.handlers[(method, path)] = handler

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.handlers[(scope["method"], scope["path"])]
        response = await handler(Request(scope, receive, send))
        await response(scope, receive, send)


class LeanApp(FastAPI):
    """The FastAPI app, whose API endpoints with a fixed path skip the framework's stack.

    ``serve_lean(routes, middleware)`` turns the path on; until then (and for every other request)
    it is the FastAPI app it extends.
    """

    _lean: ASGIApp | None = None
    _lean_routes: frozenset[tuple[str, str]] = frozenset()

    def serve_lean(self, routes: Routes, middleware: list[Wrapper]) -> None:
        app: ASGIApp = routes
        for wrap in reversed(middleware):
            app = wrap(app)
        self._lean = app
        self._lean_routes = frozenset(routes.handlers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or (scope["method"], scope["path"]) not in self._lean_routes:
            await super().__call__(scope, receive, send)
            return
        lean = self._lean
        assert lean is not None  # set with the routes
        scope["app"] = self
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            await lean(scope, receive, tracked)
        except Exception:
            # as the framework's server-error middleware does: the error shape when nothing was sent
            # yet, and the exception on to the server, which logs it and closes the connection
            log.exception("unexpected error on %s %s", scope["method"], scope["path"])
            if not started:
                await internal_error()(scope, receive, send)
            raise
