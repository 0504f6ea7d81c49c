"""OpenAI completions: ``POST /v1/completions``, a text prompt (or token ids) tokenized as is.

Nothing is canonicalized (a text prompt has no system or tools to tell apart); blocks are hashed
from the prompt's tokens, incrementally per session like chat.
"""

from __future__ import annotations

from typing import Any, Literal

from proxy.apis.base import Endpoint, NativeApi, Usage, check_stream_and_model, usage_of_json
from proxy.errors import bad_request
from proxy.ops.limits import Bounds, check_bounds

PATH = "/v1/completions"


class CompletionsApi(NativeApi):
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

    def usage(self, data: Any) -> Usage | None:
        return usage_of_json(data)


COMPLETIONS = CompletionsApi()
