"""What the pipeline needs to know about an agent API other than chat completions.

An ``AgentApi`` (``proxy/anthropic.py``, ``proxy/responses.py``) checks a request's shape, gives the
canonicalizer a chat-shaped *view* of the parts it rewrites (system text, tools, user messages) and
maps the rewritten view back into the API's own fields, converts the request into the chat body the
rank will render (``tokenization.agent_apis``), and reads usage and renders errors in its own shape.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

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


def int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def canon_view_of(slot: str, system: Any, messages: Iterable[Any], tools: list[Any]) -> dict[str, Any]:
    """The chat-shaped canonicalization view: ``system`` (when set) as a leading system message
    marked with its field name ``slot``, then ``messages``, then the chat-form ``tools`` if any."""
    view_messages: list[Any] = [{"role": "system", "content": system, SLOT: slot}] if system else []
    view_messages.extend(messages)
    view: dict[str, Any] = {"messages": view_messages}
    if tools:
        view["tools"] = tools
    return view


def unslot_messages(out: dict[str, Any], field: str, messages: list[Any]) -> list[Any]:
    """Map the view's slot message back into ``out[field]`` (dropped when canonicalization removed
    it) and return the other messages."""
    slots = [m for m in messages if isinstance(m, dict) and SLOT in m]
    if slots:
        out[field] = slots[0]["content"]
    else:
        out.pop(field, None)
    return [m for m in messages if not (isinstance(m, dict) and SLOT in m)]


def tool_from_chat(tool: dict[str, Any], original: dict[str, Any], schema_key: str) -> dict[str, Any]:
    """A rewritten chat tool in the API's flat shape, keeping the original tool's other keys."""
    fn = tool["function"]
    mapped = {**original, "name": fn["name"], schema_key: fn.get("parameters")}
    if fn.get("description") is not None:
        mapped["description"] = fn["description"]
    return mapped


def usage_of(data: Any, nested: str) -> dict[str, Any] | None:
    """The ``usage`` object of a body or event, or of its ``nested`` object (the stream's start or
    end event carries it there)."""
    if not isinstance(data, dict):
        return None
    usage = data.get("usage")
    if not isinstance(usage, dict) and isinstance(data.get(nested), dict):
        usage = data[nested].get("usage")
    return usage if isinstance(usage, dict) else None
