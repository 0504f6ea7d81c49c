"""What the pipeline needs to know about an agent API other than chat completions.

An ``AgentApi`` (``proxy/anthropic.py``, ``proxy/responses.py``) checks a request's shape, gives the
canonicalizer a chat-shaped *view* of the parts it rewrites (system text, tools, user messages) and
maps the rewritten view back into the API's own fields, converts the request into the chat body the
rank will render (``tokenization.agent_apis``), and reads usage and renders errors in its own shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import orjson
from starlette.responses import Response

from proxy.context import ApiKind
from proxy.errors import ProxyError, bad_request
from proxy.limits import Bounds
from proxy.observe import Usage

#: Key marking the view's messages that stand for a top-level field (Anthropic ``system``, Responses
#: ``instructions``); rules keep a message's other keys when they rewrite its content.
SLOT = "_prefixgate_slot"


class AgentApi(Protocol):
    kind: ApiKind

    def validate(self, body: dict[str, Any], bounds: Bounds) -> None:
        """Raise ``ProxyError(400)`` when ``body`` is not a request of this API."""
        ...

    def canon_view(self, body: dict[str, Any]) -> dict[str, Any]:
        """A chat-shaped body holding the parts canonicalization may rewrite."""
        ...

    def from_canon_view(
        self, body: dict[str, Any], before: dict[str, Any], after: dict[str, Any]
    ) -> dict[str, Any]:
        """``body`` with the rewrites of ``after`` (the canonical ``before`` view) mapped back."""
        ...

    def to_chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """The chat-completions body the rank renders for ``body`` (raises ``ConversionError``)."""
        ...

    def usage_from_json(self, data: Any) -> Usage | None:
        """Usage from a response body or a stream event, in this API's fields."""
        ...

    def error_response(self, exc: ProxyError, backend: str) -> Response: ...

    def sse_error(self, message: str) -> bytes:
        """The event ending a stream that broke after bytes reached the client."""
        ...


def check_stream_and_model(body: dict[str, Any]) -> tuple[bool, str | None]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", param="stream")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", param="model")
    return stream, model


def usage_from_body(api: AgentApi, raw: bytes) -> Usage | None:
    try:
        return api.usage_from_json(orjson.loads(raw))
    except orjson.JSONDecodeError:
        return None


def last_event_with(chunks: Iterable[bytes], needle: bytes, read: Callable[[Any], Any]) -> Any:
    """``read(event)`` of the last ``data:`` event containing ``needle`` that ``read`` accepts (not
    None), among a stream's last raw chunks; None when there is none."""
    tail = b"".join(chunks)
    end = len(tail)
    while True:
        start = tail.rfind(b"data:", 0, end)
        if start < 0:
            return None
        line_end = tail.find(b"\n", start)
        payload = tail[start + 5 : line_end if line_end >= 0 else len(tail)].strip()
        if payload.startswith(b"{") and needle in payload:
            try:
                found = read(orjson.loads(payload))
            except orjson.JSONDecodeError:
                found = None
            if found is not None:
                return found
        end = start


def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
