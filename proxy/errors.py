"""Errors as OpenAI-compatible clients expect them: ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import math

import orjson
from starlette.responses import Response

NO_BACKEND = "none"
#: Status logged (and counted) for a request whose client went away: nginx's convention.
CLIENT_CLOSED = 499


class ProxyError(Exception):
    """An error answered to the client with an OpenAI error body and the given HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, object]:
        return error_body(self.message, self.type, self.code, self.param)


def error_body(
    message: str, type_: str, code: str | None = None, param: str | None = None
) -> dict[str, object]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(exc: ProxyError, backend: str = NO_BACKEND) -> Response:
    headers = {"x-prefixgate-backend": backend, **exc.headers}
    return Response(
        orjson.dumps(exc.body()), status_code=exc.status, media_type="application/json", headers=headers
    )


def sse_error_event(message: str, type_: str = "upstream_error", code: str = "upstream_failed") -> bytes:
    """The final event of a stream that broke after bytes were already sent to the client."""
    return b"data: " + orjson.dumps(error_body(message, type_, code)) + b"\n\n"


def bad_request(message: str, param: str | None = None) -> ProxyError:
    return ProxyError(400, message, param=param, code="invalid_request")


def no_healthy_backend(why: str) -> ProxyError:
    """The 503 when no rank can take a request; ``why``: each rank and its reason
    (``proxy/unavailable.py``)."""
    return ProxyError(
        503,
        f"no healthy backend can serve this request: {why}",
        type_="service_unavailable",
        code="no_healthy_backend",
    )


def upstream_failed(detail: str) -> ProxyError:
    return ProxyError(502, f"upstream rank failed: {detail}", type_="upstream_error", code="upstream_failed")


def too_many_requests(message: str, code: str, retry_after: float) -> ProxyError:
    """A 429 with ``Retry-After`` (whole seconds, at least 1)."""
    return ProxyError(
        429,
        message,
        type_="rate_limit_error",
        code=code,
        headers={"retry-after": str(max(1, math.ceil(retry_after)))},
    )
