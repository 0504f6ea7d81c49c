"""Stage 1, parse: read the body within the size limit, check its shape in its API's terms."""

from __future__ import annotations

import time
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from proxy.apis.base import Api, check_stream_and_model
from proxy.context import RequestContext
from proxy.errors import ProxyError, bad_request
from proxy.ops.limits import Bounds
from proxy.server import TRIM_AFTER_BYTES, trim_heap
from proxy.stages.disconnect import ClientDisconnected


def too_large(limit: int) -> ProxyError:
    return ProxyError(
        413,
        f"request body exceeds the limit of {limit} bytes (max_body_bytes)",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than ``limit`` bytes without reading them all.

    A body up to ``proxy.connections.BODY_BATCH_BYTES`` comes as one piece, returned as it is.
    Larger ones go into one growing buffer rather than a list joined at the end: one allocation, in
    pages of its own once large (``proxy.server.return_freed_memory``), handed back to the system when
    the request ends, where thousands of chunks would leave the heap fragmented and resident; a
    client leaving half-way has the heap trimmed (``trim_heap``).
    """
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise too_large(limit)
        except ValueError:
            raise bad_request("invalid Content-Length header") from None
    first: bytes | None = None
    buffer: bytearray | None = None
    try:
        async for chunk in request.stream():
            if not chunk:
                continue
            if first is None:
                first = chunk
                continue
            if buffer is None:
                buffer = bytearray(first)
            buffer += chunk
            if len(buffer) > limit:
                raise too_large(limit)
    except ClientDisconnect:
        held = len(buffer) if buffer is not None else len(first or b"")
        first = buffer = None  # freed here, so that the trim below finds its pages free
        if held >= TRIM_AFTER_BYTES:
            trim_heap()
        raise ClientDisconnected() from None
    if buffer is None:
        if first is not None and len(first) > limit:
            raise too_large(limit)
        return first or b""
    return bytes(buffer)


def parse_json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise bad_request("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    return body


class Parse:
    """Reads and checks a request of ``api`` into a new ``RequestContext``."""

    def __init__(self, max_body_bytes: int, bounds: Bounds) -> None:
        self.max_body_bytes = max_body_bytes
        self.bounds = bounds

    async def __call__(self, request: Request, api: Api) -> RequestContext:
        started = time.perf_counter()
        raw = await read_body(request, self.max_body_bytes)
        body = parse_json_object(raw)
        api.validate(body, self.bounds)
        stream, model = check_stream_and_model(body)
        state = request.scope.get("state")
        return RequestContext(
            api=api,
            headers=request.headers,
            raw_body=raw,
            body=body,
            client_body=body,
            stream=stream,
            model=model,
            started=started,
            client=state.get("client") if state else None,
        )
