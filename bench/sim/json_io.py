"""JSON in and out of the simulated rank's handlers: request bodies, responses, OpenAI error bodies."""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request's JSON body; ``ValueError`` when it is not JSON or not an object."""
    data = orjson.loads(await request.body())
    if not isinstance(data, dict):
        raise ValueError("the request body must be a JSON object")
    return data


def json_response(body: Any, status: int = 200) -> Response:
    """``body`` as an ``application/json`` response."""
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def openai_error(message: str, status: int, kind: str, param: str | None = None) -> Response:
    """An OpenAI-shaped error body: ``{"error": {message, type, param, code}}``, ``code`` = status."""
    return json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}, status
    )


def bad_request(message: str) -> Response:
    """A 400 as vLLM's OpenAI server words it (``type`` ``BadRequestError``)."""
    return openai_error(message, 400, "BadRequestError")
