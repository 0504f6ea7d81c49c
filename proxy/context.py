"""The typed record a request carries through the pipeline stages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from starlette.datastructures import Headers

from routing.backends import Backend
from tokenization.prompt import PromptBlocks


class ApiKind(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"

    @property
    def upstream_path(self) -> str:
        return "/v1/chat/completions" if self is ApiKind.CHAT else "/v1/completions"


@dataclass(slots=True)
class RequestContext:
    """One client request. Stages fill in their fields in pipeline order."""

    api: ApiKind
    headers: Headers
    raw_body: bytes
    body: dict[str, Any]
    stream: bool
    model: str | None
    started: float
    # identify session
    session_key: str | None = None
    session_source: str | None = None
    # canonicalize: when a stage rewrites ``body`` it sets this, and forwarding re-serializes it;
    # otherwise the client's bytes are forwarded untouched.
    body_changed: bool = False
    # render and hash blocks
    prompt_tokens: int | None = None
    block_hashes: Sequence[bytes] = ()
    prompt_blocks: PromptBlocks | None = None
    # pick a rank / forward
    backend: Backend | None = None
    attempts: int = 0
    # the router's prediction of the rank's prefix-cache hit (None when the prompt's blocks are unknown)
    estimated_cached_tokens: int | None = None

    def upstream_body(self) -> bytes:
        if not self.body_changed:
            return self.raw_body
        import orjson

        return orjson.dumps(self.body)
