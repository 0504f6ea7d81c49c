"""The Anthropic Messages API (Claude Code): ``POST /v1/messages`` and ``/v1/messages/count_tokens``.

The rank serves this API itself (vLLM's ``/v1/messages``); prefixgate forwards the client's request
at the same path and relays the answer in Anthropic's SSE events. For tokenization the request is
converted into the chat body vLLM renders (``tokenization.chat_conversion``, shared with the simulator).


Canonicalization sees ``system`` (a string, or text blocks whose ``cache_control`` markers ride
along untouched) as the leading system message, the messages as they are, and the tools in chat
form; the rewrites go back into ``system``, ``messages`` and ``tools`` (each rewritten tool keeps
its other keys, ``cache_control`` included). Hits come from ``usage.cache_read_input_tokens``;
vLLM reports ``input_tokens`` net of cache reads and writes, so the prompt is their sum.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from starlette.responses import Response

from proxy.apis.base import (
    Endpoint,
    NativeApi,
    Usage,
    canon_view_of,
    check_stream_and_model,
    first_user_head,
    int_or_none,
    tool_from_chat,
    unslot_messages,
    usage_of,
)
from proxy.errors import ProxyError, bad_request
from proxy.ops.limits import Bounds, check_bounds
from tokenization.chat_conversion import ConversionError, anthropic_to_chat, anthropic_tools_to_chat

PATH = "/v1/messages"
COUNT_TOKENS_PATH = "/v1/messages/count_tokens"

#: Anthropic's error ``type`` per HTTP status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class MessagesApi(NativeApi):
    name = "messages"
    endpoints: tuple[Endpoint, ...] = (
        Endpoint("POST", PATH, "complete", PATH),
        Endpoint("POST", COUNT_TOKENS_PATH, "count", COUNT_TOKENS_PATH),
    )
    prompt_kind: Literal["chat", "text"] = "chat"
    stream_end = b"event: message_stop"

    def validate(self, body: dict[str, Any], bounds: Bounds) -> None:
        check_stream_and_model(body)
        if not isinstance(body.get("messages"), list):
            raise bad_request("'messages' must be a list of messages", param="messages")
        system = body.get("system")
        if system is not None and not isinstance(system, (str, list)):
            raise bad_request("'system' must be a string or a list of text blocks", param="system")
        check_bounds(body, bounds)

    def head(self, body: dict[str, Any]) -> Any:
        return first_user_head(body.get("system"), body.get("messages"), body.get("tools"))

    def canon_view(self, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            tools = anthropic_tools_to_chat(body)
        except ConversionError as exc:
            raise bad_request(str(exc)) from None
        return canon_view_of("system", body.get("system"), body["messages"], tools)

    def from_canon_view(
        self, body: dict[str, Any], before: dict[str, Any], after: dict[str, Any]
    ) -> dict[str, Any]:
        out = dict(body)
        if after.get("messages") is not before.get("messages"):
            out["messages"] = unslot_messages(out, "system", after["messages"])
        if after.get("tools") is not before.get("tools"):
            originals = {t.get("name"): t for t in body.get("tools") or () if isinstance(t, dict)}
            out["tools"] = [
                tool_from_chat(tool, originals.get(tool["function"]["name"], {}), "input_schema")
                for tool in after.get("tools") or ()
            ]
        return out

    def prompt_view(self, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return anthropic_to_chat(body)
        except ConversionError as exc:
            raise bad_request(str(exc)) from None

    def usage(self, data: Any) -> Usage | None:
        usage = usage_of(data, "message")  # nested in message_start
        if usage is None:
            return None
        fresh = int_or_none(usage.get("input_tokens"))
        output = int_or_none(usage.get("output_tokens"))
        if fresh is None or output is None:
            return None
        read = int_or_none(usage.get("cache_read_input_tokens"))
        created = int_or_none(usage.get("cache_creation_input_tokens")) or 0
        return Usage(fresh + (read or 0) + created, output, read)

    def error_response(self, exc: ProxyError, rank: str) -> Response:
        headers = {"x-prefixgate-backend": rank, **exc.headers}
        body = orjson.dumps(error_body(exc.status, exc.message))
        return Response(body, status_code=exc.status, media_type="application/json", headers=headers)

    def sse_error(self, message: str) -> bytes:
        return b"event: error\ndata: " + orjson.dumps(error_body(502, message)) + b"\n\n"


MESSAGES = MessagesApi()
