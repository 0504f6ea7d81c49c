"""Stage 2, identify the session: which conversation does this request continue?

In order: the first configured header present, then body fields agents set (``prompt_cache_key``,
``metadata.session_id``, ``metadata.user_id``, ``user``), else a fingerprint of the requested model
and the conversation's stable head (system, tools, first user message, as the API names them): the
same agent task re-sends the same head to the same model every turn, and two conversations that
open alike ("hi") with different models are different sessions. The session's local state
(``proxy.state.local``) is opened for the stages after this one.

The key is made safe (``proxy.tenants.safe_key``: printable ASCII, bounded) and, with client keys
configured, namespaced by the client's key: one client can never continue another's session.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import orjson
import xxhash

from proxy.context import RequestContext
from proxy.state.local import SessionLocals
from proxy.tenants import safe_key, tenant_key

#: Headers by which a client says a request is its session's last: prefixgate's own, and Dynamo's
#: (which agents' harnesses send on a dedicated minimal request when the session ends).
SESSION_END_HEADERS: tuple[str, ...] = ("x-prefixgate-session-end", "x-dynamo-session-final")
TRUE_VALUES = frozenset({"1", "true", "yes"})
#: A request's priority class for a seat (an integer, higher first): honoured with client keys only,
#: up to the class its key was granted (the keys file's ``max_priority``, else its ``priority``).
PRIORITY_HEADER = "x-prefixgate-priority"

DEFAULT_SESSION_HEADERS: tuple[str, ...] = (
    "x-session-id",
    "x-claude-code-session-id",
    "session-id",
    "x-task-id",
)


def priority_of(ctx: RequestContext) -> int:
    """``ctx``'s priority class: what its ``PRIORITY_HEADER`` asks, capped by its key's grant; its
    key's priority without one; 0 without client keys (nobody's grant to check against)."""
    client = ctx.client
    if client is None:
        return 0
    asked = (ctx.headers.get(PRIORITY_HEADER) or "").strip()
    try:
        return client.granted(int(asked)) if asked else client.priority
    except ValueError:
        return client.priority  # not an integer: the key's own class, as without the header


def body_key(body: dict[str, Any]) -> tuple[str, str] | None:
    """The session key an agent put in the body, and where: (key, source) or None."""
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


def fingerprint(head: Any, model: str | None = None) -> str | None:
    """A digest of the model and a conversation's head (``Api.head``), or None when it has no head."""
    if head is None:
        return None
    try:
        data = orjson.dumps([model, head])
    except TypeError:
        return None
    return "fp-" + xxhash.xxh3_64_hexdigest(data)


class Identify:
    """Sets ``ctx.session_key``, ``ctx.session_source``, ``ctx.session_ends``, ``ctx.priority`` and
    ``ctx.local``."""

    def __init__(self, locals_: SessionLocals, headers: Sequence[str] = DEFAULT_SESSION_HEADERS) -> None:
        self.locals = locals_
        self.headers = headers

    def __call__(self, ctx: RequestContext) -> None:
        found = self.key_of(ctx)
        if found is None:
            return
        key = tenant_key(ctx.client_label, safe_key(found[0]))
        ctx.session_key, ctx.session_source = key, found[1]
        ctx.session_ends = any(
            (ctx.headers.get(name) or "").strip().lower() in TRUE_VALUES for name in SESSION_END_HEADERS
        )
        ctx.priority = priority_of(ctx)
        ctx.local = self.locals.open(key)

    def key_of(self, ctx: RequestContext) -> tuple[str, str] | None:
        for name in self.headers:
            value = ctx.headers.get(name)
            if value:
                return value, f"header:{name}"
        found = body_key(ctx.body)
        if found is not None:
            return found
        key = fingerprint(ctx.api.head(ctx.body), ctx.model)
        return (key, "fingerprint") if key is not None else None
