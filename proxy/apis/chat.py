"""OpenAI chat completions: ``POST /v1/chat/completions``, the API vLLM renders natively.

The body is its own canonicalization view and its own prompt view: the rules rewrite its leading
system messages and ``tools`` in place, and the tokenizer renders its messages through the chat
template.
"""

from __future__ import annotations

from typing import Any, Literal

from proxy.apis.base import Endpoint, NativeApi, Usage, check_stream_and_model, first_user_head, usage_of_json
from proxy.errors import bad_request
from proxy.ops.limits import Bounds, check_bounds

PATH = "/v1/chat/completions"


class ChatApi(NativeApi):
    name = "chat"
    endpoints: tuple[Endpoint, ...] = (Endpoint("POST", PATH, "complete", PATH),)
    prompt_kind: Literal["chat", "text"] = "chat"

    def validate(self, body: dict[str, Any], bounds: Bounds) -> None:
        check_stream_and_model(body)
        if not isinstance(body.get("messages"), list):
            raise bad_request("'messages' must be a list of messages", param="messages")
        check_bounds(body, bounds)

    def head(self, body: dict[str, Any]) -> Any:
        return first_user_head(None, body.get("messages"), body.get("tools"))

    def canon_view(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return body

    def from_canon_view(
        self, body: dict[str, Any], before: dict[str, Any], after: dict[str, Any]
    ) -> dict[str, Any]:
        return after

    def prompt_view(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return body

    def usage(self, data: Any) -> Usage | None:
        return usage_of_json(data)


CHAT = ChatApi()
