"""The typed record a request carries through the pipeline stages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from starlette.datastructures import Headers

from routing.ranks import Rank
from tokenization.prompt import PromptBlocks


class ApiKind(StrEnum):
    CHAT = "chat"
    COMPLETIONS = "completions"
    MESSAGES = "messages"  # Anthropic Messages (proxy/anthropic.py)
    RESPONSES = "responses"  # OpenAI Responses (proxy/responses.py)

    @property
    def upstream_path(self) -> str:
        return _UPSTREAM_PATHS[self]


_UPSTREAM_PATHS = {
    ApiKind.CHAT: "/v1/chat/completions",
    ApiKind.COMPLETIONS: "/v1/completions",
    ApiKind.MESSAGES: "/v1/messages",
    ApiKind.RESPONSES: "/v1/responses",
}


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
    # the label of the client's API key (proxy/auth.py); None when client keys are not configured.
    # Never the key itself.
    client_label: str | None = None
    # identify session
    session_key: str | None = None
    session_source: str | None = None
    # canonicalize: when a stage rewrites ``body`` it sets this, and forwarding re-serializes it;
    # otherwise the client's bytes are forwarded untouched.
    body_changed: bool = False
    rewrites: dict[str, int] | None = None  # rule -> count, when canonicalization changed the body
    # render and hash blocks
    prompt_tokens: int | None = None
    block_hashes: Sequence[bytes] = ()
    prompt_blocks: PromptBlocks | None = None
    # pick a rank / forward
    backend: Rank | None = None
    attempts: int = 0
    # the router's prediction of the rank's prefix-cache hit (None when the prompt's blocks are unknown)
    estimated_cached_tokens: int | None = None
    # admission (proxy/admission.py): the client key's session cap, the ranks a new session may go
    # to (None: any) and the session's record (a ``proxy.sessions.Session``)
    client_max_sessions: int | None = None
    allowed_backends: frozenset[str] | None = None
    session: Any = None
    # admission: the rank an admitted (active) session is accounted on; the router keeps it there
    # unless that rank is down or saturated
    home_backend: str | None = None

    def upstream_body(self) -> bytes:
        if not self.body_changed:
            return self.raw_body
        import orjson

        return orjson.dumps(self.body)
