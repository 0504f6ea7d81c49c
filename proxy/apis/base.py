"""What the pipeline needs to know about a client API: one module per API behind ``Api``.

An API module (``chat.py``, ``completions.py``, ``messages.py``, ``responses.py``) checks a request's
shape, gives the canonicalizer a chat-shaped *view* of the parts it rewrites (system text, tools,
messages) and maps the rewritten view back into the API's own fields, gives the tokenizer the body
the rank renders (chat messages, or a text prompt), reads usage and stored-answer ids in its own
fields, and renders errors in its own shape. Register a new API with one line in
``proxy/apis/__init__.py``.

What a rank reports of a request's tokens (``Usage``) is read here too, in the shape every API's
answer is read into: from a plain response's JSON body, or from the last events of a stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import orjson
from starlette.responses import Response

from proxy.errors import ProxyError, bad_request, error_response, sse_error_event
from proxy.ops.limits import Bounds

#: Key marking the view's messages that stand for a top-level field (Anthropic ``system``, Responses
#: ``instructions``); rules keep a message's other keys when they rewrite its content.
SLOT = "_prefixgate_slot"

# -- what a rank reported ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    """What a rank reported about a request's tokens: read from the JSON body of a plain response or
    from the tail of a stream (vLLM sends the usage chunk last, just before ``data: [DONE]``), so
    streamed chunks are never parsed one by one."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # None: the rank did not say (no --enable-prompt-tokens-details)


def usage_from_dict(usage: Any) -> Usage | None:
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens", 0)
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt, completion, cached if isinstance(cached, int) else None)


def usage_of_json(data: Any) -> Usage | None:
    """Usage from a chat/completions response body or stream chunk, already parsed."""
    return usage_from_dict(data.get("usage")) if isinstance(data, dict) else None


def json_or_none(body: bytes) -> Any:
    """A plain response's parsed JSON body; None when it is not JSON."""
    try:
        return orjson.loads(body)
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


# -- the API ----------------------------------------------------------------------------------------

#: What an endpoint does: ``complete`` runs the whole pipeline; ``count`` canonicalizes and asks any
#: healthy rank (nothing is cached, so nothing is routed by prefix); ``retrieve`` fetches a stored
#: answer from the rank that stored it.
Action = Literal["complete", "count", "retrieve"]


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One HTTP route of an API: ``method`` ``path`` on prefixgate, ``upstream`` on the rank."""

    method: Literal["GET", "POST"]
    path: str
    action: Action
    upstream: str


class Translation(Protocol):
    """One request of an API the rank does not serve natively: the request in the rank's API, and
    the rank's answer in the client's (a stream chunk by chunk)."""

    def request(self, body: dict[str, Any]) -> bytes:
        """The body sent to the rank (at the endpoint's ``upstream`` path) for the client's ``body``."""
        ...

    def chunk(self, data: bytes) -> bytes:
        """A streamed chunk in the client's format (b"" to hold it back)."""
        ...

    def body(self, data: bytes) -> bytes:
        """A whole (non-streamed) answer in the client's format."""
        ...

    def end(self) -> bytes:
        """What the client's stream ends with, after the rank's last chunk."""
        ...


class Api(Protocol):
    """A client API prefixgate serves."""

    #: Short name: the request context's ``api``, log lines, metrics' endpoint labels come from paths.
    name: str
    #: The routes, the first being the main one (``complete``).
    endpoints: tuple[Endpoint, ...]
    #: How the rank renders the prompt: ``chat`` (messages and tools, through the chat template) or
    #: ``text`` (a completion prompt, tokenized as is).
    prompt_kind: Literal["chat", "text"]
    #: The start of the SSE line of a stream's last event (``data: [DONE]``): the answer is observed
    #: before the chunk holding it reaches the client, so the client's next request finds it counted.
    stream_end: bytes
    #: The events a rank's stream of this API opens with before its prefill is done (vLLM's
    #: Responses stream sends ``response.created`` and ``response.in_progress`` at once): the
    #: prefill is done at the first chunk naming another event. Empty: at the first chunk.
    stream_preamble: frozenset[bytes]

    def validate(self, body: dict[str, Any], bounds: Bounds) -> None:
        """Raise ``ProxyError(400)`` when ``body`` is not a request of this API (``stream`` and
        ``model`` included: ``check_stream_and_model``)."""
        ...

    def head(self, body: dict[str, Any]) -> Any:
        """The conversation's stable head (system, tools, first user message) as JSON-able data, for
        the session fingerprint; None when the request has none."""
        ...

    def canon_view(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """A chat-shaped body holding the parts canonicalization may rewrite; None: not canonicalized."""
        ...

    def from_canon_view(
        self, body: dict[str, Any], before: dict[str, Any], after: dict[str, Any]
    ) -> dict[str, Any]:
        """``body`` with the rewrites of ``after`` (the canonical ``before`` view) mapped back."""
        ...

    def prompt_view(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """The body the rank renders into tokens: a chat-completions body (``prompt_kind`` chat) or a
        completions body (text); None when ``body`` is not the whole prompt (it continues a stored
        answer). Raises ``ProxyError(400)`` when it cannot be converted."""
        ...

    def continues(self, body: dict[str, Any]) -> str | None:
        """The id of a stored answer this request continues: it must reach the rank storing it."""
        ...

    def usage(self, data: Any) -> Usage | None:
        """Usage from a response body or a stream event, in this API's fields."""
        ...

    def stored_id(self, data: Any) -> str | None:
        """The id of the answer the rank stored, from a response body or a stream event (None: none)."""
        ...

    def error_response(self, exc: ProxyError, rank: str) -> Response: ...

    def sse_error(self, message: str) -> bytes:
        """The event ending a stream that broke after bytes reached the client."""
        ...

    def translation(self) -> Translation | None:
        """A new translation for one request, when the rank does not serve this API natively (None:
        the client's request goes to the rank as it is, and the rank's answer back as it is)."""
        ...


class NativeApi:
    """What most APIs share: the rank serves them natively (no translation), they continue no stored
    answer and store none, their errors take OpenAI's shape and their streams end with
    ``data: [DONE]``. An API overrides what differs."""

    stream_end = b"data: [DONE]"
    stream_preamble: frozenset[bytes] = frozenset()

    def continues(self, body: dict[str, Any]) -> str | None:
        return None

    def stored_id(self, data: Any) -> str | None:
        return None

    def error_response(self, exc: ProxyError, rank: str) -> Response:
        return error_response(exc, rank)

    def sse_error(self, message: str) -> bytes:
        return sse_error_event(message)

    def translation(self) -> Translation | None:
        return None


def check_stream_and_model(body: dict[str, Any]) -> tuple[bool, str | None]:
    """``stream`` (a boolean; absent or null: false) and ``model`` (a string, or absent)."""
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


def canon_view_of(slot: str, system: Any, messages: Iterable[Any], tools: list[Any] | None) -> dict[str, Any]:
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


def first_user_head(system: Any, messages: Any, tools: Any) -> list[Any] | None:
    """``[system, messages up to the first user message, tools]``: a conversation's stable head."""
    if not isinstance(messages, list) or not messages:
        return None
    head: list[Any] = []
    for message in messages:
        head.append(message)
        if isinstance(message, dict) and message.get("role") == "user":
            break
    return [system, head, tools]
