"""OpenAI completions: ``POST /v1/completions``, a text prompt (or token ids) tokenized as is.

Nothing is canonicalized (a text prompt has no system or tools to tell apart); blocks are hashed
from the prompt's tokens, incrementally per session like chat.
"""

from __future__ import annotations

from typing import Any, Literal

from starlette.responses import Response

from proxy.apis.base import Endpoint, check_stream_and_model
from proxy.errors import ProxyError, bad_request, error_response, sse_error_event
from proxy.ops.limits import Bounds, check_bounds
from proxy.stages.usage import Usage, usage_of_json

PATH = "/v1/completions"


class CompletionsApi:
    name = "completions"
    endpoints: tuple[Endpoint, ...] = (Endpoint("POST", PATH, "complete", PATH),)
    prompt_kind: Literal["chat", "text"] = "text"

    def validate(self, body: dict[str, Any], bounds: Bounds) -> None:
        check_stream_and_model(body)
        if "prompt" not in body:
            raise bad_request("'prompt' is required", param="prompt")
        check_bounds(body, bounds, messages=False)

    def head(self, body: dict[str, Any]) -> Any:
        return None  # a text prompt has no head to tell sessions apart

    def canon_view(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return None

    def from_canon_view(
        self, body: dict[str, Any], before: dict[str, Any], after: dict[str, Any]
    ) -> dict[str, Any]:
        return body

    def prompt_view(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return body

    def continues(self, body: dict[str, Any]) -> str | None:
        return None

    def usage(self, data: Any) -> Usage | None:
        return usage_of_json(data)

    def stored_id(self, data: Any) -> str | None:
        return None

    def error_response(self, exc: ProxyError, rank: str) -> Response:
        return error_response(exc, rank)

    def sse_error(self, message: str) -> bytes:
        return sse_error_event(message)

    def translation(self) -> None:
        return None


COMPLETIONS = CompletionsApi()
