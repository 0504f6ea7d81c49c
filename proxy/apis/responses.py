"""OpenAI's Responses API (Codex CLI): ``POST /v1/responses`` and ``GET /v1/responses/{id}``.

Canonicalization sees ``instructions`` as the leading system message, the ``input`` items as
messages (a string input as one user message) and the function tools in chat form; the rewrites go
back into ``instructions``, ``input`` (text parts added to a message become ``input_text``) and
``tools`` (non-function tools kept after the function ones). Hits come from
``usage.input_tokens_details.cached_tokens``.

A rank stores the responses it generated. A request continuing one (``previous_response_id``) and a
retrieval must reach that rank (``continues``: the routing stage pins the request there, through
``proxy.state.responses``); its input is then only the new turn, not the whole prompt, so it has no
prompt view to hash.
"""

from __future__ import annotations

from typing import Any, Literal

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
from proxy.errors import bad_request
from proxy.ops.limits import Bounds, check_bounds, too_many
from tokenization.chat_conversion import (
    ConversionError,
    is_one_of,
    responses_to_chat,
    responses_tools_to_chat,
)

PATH = "/v1/responses"
_TEXT_ROLES = frozenset({"user", "system", "developer"})


class ResponsesApi(NativeApi):
    name = "responses"
    endpoints: tuple[Endpoint, ...] = (
        Endpoint("POST", PATH, "complete", PATH),
        Endpoint("GET", PATH + "/{response_id}", "retrieve", PATH),
    )
    prompt_kind: Literal["chat", "text"] = "chat"
    stream_end = b"event: response.completed"
    # vLLM's Responses stream yields these two before it awaits the engine's first output
    # (``responses_stream_generator``); its first output item comes with the first token
    stream_preamble = frozenset({b"response.created", b"response.in_progress"})

    def validate(self, body: dict[str, Any], bounds: Bounds) -> None:
        check_stream_and_model(body)
        items = body.get("input")
        if not isinstance(items, (str, list)):
            raise bad_request("'input' must be a string or a list of items", param="input")
        if isinstance(items, list) and len(items) > bounds.max_messages:
            raise too_many(
                "input items", len(items), bounds.max_messages, "max_messages", "input", "too_many_messages"
            )
        previous = body.get("previous_response_id")
        if previous is not None and not (isinstance(previous, str) and previous):
            raise bad_request("'previous_response_id' must be a string", param="previous_response_id")
        check_bounds(body, bounds, messages=False)

    def head(self, body: dict[str, Any]) -> Any:
        items = body.get("input")
        messages = [{"role": "user", "content": items}] if isinstance(items, str) else items
        return first_user_head(body.get("instructions"), messages, body.get("tools"))

    def canon_view(self, body: dict[str, Any]) -> dict[str, Any] | None:
        instructions = body.get("instructions")
        items = body["input"]
        try:
            tools = responses_tools_to_chat(body)
        except ConversionError as exc:
            raise bad_request(str(exc)) from None
        return canon_view_of(
            "instructions",
            instructions if isinstance(instructions, str) else None,
            [{"role": "user", "content": items}] if isinstance(items, str) else items,
            tools,
        )

    def from_canon_view(
        self, body: dict[str, Any], before: dict[str, Any], after: dict[str, Any]
    ) -> dict[str, Any]:
        out = dict(body)
        if after.get("messages") is not before.get("messages"):
            out["input"] = [_input_item(m) for m in unslot_messages(out, "instructions", after["messages"])]
        if after.get("tools") is not before.get("tools"):
            originals = body.get("tools") or []
            by_name = {
                t.get("name"): t for t in originals if isinstance(t, dict) and t.get("type") == "function"
            }
            function = {"type": "function"}
            tools: list[Any] = [
                tool_from_chat(tool, by_name.get(tool["function"]["name"], function), "parameters")
                for tool in after.get("tools") or ()
            ]
            tools.extend(t for t in originals if not (isinstance(t, dict) and t.get("type") == "function"))
            out["tools"] = tools
        return out

    def prompt_view(self, body: dict[str, Any]) -> dict[str, Any] | None:
        if self.continues(body) is not None:
            return None  # the input is the new turn only: the rank holds the rest
        try:
            return responses_to_chat(body)
        except ConversionError as exc:
            raise bad_request(str(exc)) from None

    def continues(self, body: dict[str, Any]) -> str | None:
        previous = body.get("previous_response_id")
        return previous if isinstance(previous, str) and previous else None

    def usage(self, data: Any) -> Usage | None:
        usage = usage_of(data, "response")  # nested in response.completed
        if usage is None:
            return None
        prompt = int_or_none(usage.get("input_tokens"))
        output = int_or_none(usage.get("output_tokens"))
        if prompt is None or output is None:
            return None
        details = usage.get("input_tokens_details")
        cached = int_or_none(details.get("cached_tokens")) if isinstance(details, dict) else None
        return Usage(prompt, output, cached)

    def stored_id(self, data: Any) -> str | None:
        """The response's id: a response body's ``id``, or a stream event's ``response.id``."""
        if not isinstance(data, dict):
            return None
        response = data.get("response")
        if not isinstance(response, dict):
            response = data if data.get("object") == "response" or "output" in data else None
        value = response.get("id") if response is not None else None
        return value if isinstance(value, str) and value else None


def _input_item(message: Any) -> Any:
    """A view message as a Responses input item: text parts the rules added become ``input_text``."""
    if not isinstance(message, dict) or not is_one_of(message.get("role"), _TEXT_ROLES):
        return message
    content = message.get("content")
    if not isinstance(content, list) or not any(
        isinstance(p, dict) and p.get("type") == "text" for p in content
    ):
        return message
    parts = [
        {**p, "type": "input_text"} if isinstance(p, dict) and p.get("type") == "text" else p for p in content
    ]
    return {**message, "content": parts}


RESPONSES = ResponsesApi()
