"""Stage 1, parse: read the body within the size limit and check its shape."""

from __future__ import annotations

import time

import orjson
from starlette.requests import Request

from proxy.context import ApiKind, RequestContext
from proxy.errors import ProxyError, bad_request
from proxy.limits import DEFAULT_BOUNDS, Bounds, check_bounds


def too_large(limit: int) -> ProxyError:
    return ProxyError(
        413,
        f"request body exceeds the limit of {limit} bytes (max_body_bytes)",
        code="request_too_large",
    )


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refusing more than ``limit`` bytes without reading them all."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise too_large(limit)
        except ValueError:
            raise bad_request("invalid Content-Length header") from None
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def parse_json_object(raw: bytes) -> dict:
    if not raw:
        raise bad_request("request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request(f"request body must be a JSON object, got {type(body).__name__}")
    return body


async def parse_request(
    request: Request, api: ApiKind, max_body_bytes: int, bounds: Bounds = DEFAULT_BOUNDS
) -> RequestContext:
    started = time.perf_counter()
    raw = await read_body(request, max_body_bytes)
    body = parse_json_object(raw)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", param="stream")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    if api is ApiKind.CHAT and not isinstance(body.get("messages"), list):
        raise bad_request("'messages' must be a list of messages", param="messages")
    if api is ApiKind.COMPLETIONS and "prompt" not in body:
        raise bad_request("'prompt' is required", param="prompt")
    check_bounds(body, api, bounds)
    return new_context(request, api, raw, body, stream, started)


def new_context(
    request: Request, api: ApiKind, raw: bytes, body: dict, stream: bool, started: float
) -> RequestContext:
    """The request's context once its body is parsed and checked, with what authentication learned
    about the client (``request.scope["state"]``)."""
    state = request.scope.get("state")
    return RequestContext(
        api=api,
        headers=request.headers,
        raw_body=raw,
        body=body,
        stream=stream,
        model=body.get("model"),
        started=started,
        client_label=state.get("client_label") if state else None,
        client_max_sessions=state.get("client_max_sessions") if state else None,
    )
