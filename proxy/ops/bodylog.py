"""``--log-bodies``: log request and response bodies (prompts and completions).

Off by default, and then nothing here runs: prefixgate logs no prompt or completion text
otherwise. When on, the middleware tees the request body and the response body (a whole SSE stream
too) of the completion endpoints, and logs both once the response is complete, on the
``prefixgate.bodies`` logger, with the client's key label, never its key.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("prefixgate.bodies")

LOGGED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
#: Longest body logged per direction; longer ones are cut (agent prompts reach megabytes).
MAX_LOGGED_BYTES = 256 * 1024


def _clip(parts: list[bytes]) -> str:
    data = b"".join(parts)
    suffix = f"... ({len(data)} bytes)" if len(data) > MAX_LOGGED_BYTES else ""
    return data[:MAX_LOGGED_BYTES].decode("utf-8", "replace") + suffix


class BodyLogMiddleware:
    """Logs the request and response bodies of completion requests (only installed with --log-bodies)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in LOGGED_PATHS:
            await self.app(scope, receive, send)
            return
        request_parts: list[bytes] = []
        response_parts: list[bytes] = []
        status = 0
        logged = False

        def write_log() -> None:
            nonlocal logged
            logged = True
            label = (scope.get("state") or {}).get("client_label")
            log.info(
                "%s %s client=%s status=%s\nrequest: %s\nresponse: %s",
                scope["method"],
                scope["path"],
                label,
                status,
                _clip(request_parts),
                _clip(response_parts),
            )

        async def tee_receive() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                request_parts.append(message.get("body", b""))
            return message

        async def tee_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                response_parts.append(message.get("body", b""))
                if not message.get("more_body", False):
                    write_log()  # before the client can see the end of its response
            await send(message)

        try:
            await self.app(scope, tee_receive, tee_send)
        finally:
            if not logged:  # the client went away, or the app failed
                write_log()
