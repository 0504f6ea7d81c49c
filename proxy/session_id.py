"""Stage 2, identify the session: which conversation does this request continue?

In order: the first configured header present, then body fields agents set (``prompt_cache_key``,
``metadata.session_id``, ``metadata.user_id``, ``user``), else a fingerprint of the conversation's
stable head (system messages, tools, first user message): the same agent task re-sends the same
head every turn.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import xxhash

from proxy.context import RequestContext

DEFAULT_SESSION_HEADERS: tuple[str, ...] = (
    "x-session-id",
    "x-claude-code-session-id",
    "session-id",
    "x-task-id",
)


def _body_key(body: dict[str, Any]) -> tuple[str, str] | None:
    value = body.get("prompt_cache_key")
    if isinstance(value, str) and value:
        return value, "body:prompt_cache_key"
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        for name in ("session_id", "user_id"):
            value = metadata.get(name)
            if isinstance(value, str) and value:
                return value, f"body:metadata.{name}"
    value = body.get("user")
    if isinstance(value, str) and value:
        return value, "body:user"
    return None


def fingerprint(body: dict[str, Any]) -> str | None:
    """A digest of the conversation head, or None when the request has no messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return None
    head: list[Any] = []
    for message in messages:
        head.append(message)
        if isinstance(message, dict) and message.get("role") == "user":
            break
    try:
        data = orjson.dumps([head, body.get("tools")])
    except TypeError:
        return None
    return "fp-" + xxhash.xxh3_64_hexdigest(data)


def identify_session(ctx: RequestContext, headers: Sequence[str] = DEFAULT_SESSION_HEADERS) -> None:
    for name in headers:
        value = ctx.headers.get(name)
        if value:
            ctx.session_key, ctx.session_source = value, f"header:{name}"
            return
    found = _body_key(ctx.body)
    if found is not None:
        ctx.session_key, ctx.session_source = found
        return
    key = fingerprint(ctx.body)
    if key is not None:
        ctx.session_key, ctx.session_source = key, "fingerprint"
