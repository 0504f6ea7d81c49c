"""Stage 2, identify the session: which conversation does this request continue?

In order: a parent session header (``PARENT_SESSION_HEADERS``: a sub-agent that its agent runs as a
child session, opencode's ``x-parent-session-id``) joins the parent's session, and the child's own
session id names its thread there (``RequestContext.session_thread``); then the first configured
session header present; then body fields agents set (``prompt_cache_key``, ``metadata.session_id``,
``metadata.user_id``, ``user``); else a fingerprint of the requested model and the conversation's
stable head (system, tools, first user message, as the API names them): the same agent task re-sends
the same head to the same model every turn, and two conversations that open alike ("hi") with
different models are different sessions. The session's local state (``proxy.state.local``) is
opened for the stages after this one.

A child of a child (a sub-agent's sub-agent) joins the session its parent joined, as far as this
process saw the parent; each child keeps the session it was first given, so none is ever split.

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
from tokenization.lru import LRU

#: Headers by which a client says a request is its session's last: prefixgate's own, and Dynamo's
#: (which agents' harnesses send on a dedicated minimal request when the session ends).
SESSION_END_HEADERS: tuple[str, ...] = ("x-prefixgate-session-end", "x-dynamo-session-final")
TRUE_VALUES = frozenset({"1", "true", "yes"})
#: A request's priority class for a seat (an integer, higher first): honoured with client keys only,
#: up to the class its key was granted (the keys file's ``max_priority``, else its ``priority``).
PRIORITY_HEADER = "x-prefixgate-priority"

#: Session headers, first present wins: the generic one, Claude Code's, Codex's, opencode's (its
#: ``x-session-id`` carries the same id; ``x-opencode-session`` towards opencode's own providers), Cline's.
DEFAULT_SESSION_HEADERS: tuple[str, ...] = (
    "x-session-id",
    "x-claude-code-session-id",
    "session-id",
    "x-session-affinity",
    "x-opencode-session",
    "x-task-id",
)
#: Headers naming the parent session of a child session (opencode runs a sub-agent as a session of
#: its own, with its own session id): such a request is a thread of the parent's session.
PARENT_SESSION_HEADERS: tuple[str, ...] = ("x-parent-session-id",)
#: Child sessions whose session (the root they joined) this process remembers.
MAX_CHILDREN = 65_536


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
    """Sets ``ctx.session_key``, ``ctx.session_source``, ``ctx.session_ends``, ``ctx.priority``,
    ``ctx.local`` and, for a child session, ``ctx.session_thread``."""

    def __init__(
        self,
        locals_: SessionLocals,
        headers: Sequence[str] = DEFAULT_SESSION_HEADERS,
        parent_headers: Sequence[str] = PARENT_SESSION_HEADERS,
    ) -> None:
        self.locals = locals_
        self.headers = headers
        self.parent_headers = tuple(parent_headers)
        #: (client, a child session's own id) -> the session id it joined (its parent's, or its root).
        self.roots: LRU[tuple[str | None, str], str] = LRU(MAX_CHILDREN)

    def __call__(self, ctx: RequestContext) -> None:
        found = self.key_of(ctx)
        if found is None:
            return
        key = tenant_key(ctx.client_label, safe_key(found[0]))
        ctx.session_key, ctx.session_source = key, found[1]
        # a sub-agent's end is its thread's, not the session's it joined: the seat stays
        ctx.session_ends = ctx.session_thread is None and any(
            (ctx.headers.get(name) or "").strip().lower() in TRUE_VALUES for name in SESSION_END_HEADERS
        )
        ctx.priority = priority_of(ctx)
        ctx.local = self.locals.open(key)

    def key_of(self, ctx: RequestContext) -> tuple[str, str] | None:
        own = next(((value, name) for name in self.headers if (value := ctx.headers.get(name))), None)
        for name in self.parent_headers:
            parent = ctx.headers.get(name)
            if parent and (own is None or own[0] != parent):
                return self._joined(ctx, parent, own[0] if own else None), f"header:{name}"
        if own is not None:
            return own[0], f"header:{own[1]}"
        found = body_key(ctx.body)
        if found is not None:
            return found
        key = fingerprint(ctx.api.head(ctx.body), ctx.model)
        return (key, "fingerprint") if key is not None else None

    def _joined(self, ctx: RequestContext, parent: str, own: str | None) -> str:
        """The session a child session with id ``own`` (if it sent one) and parent ``parent`` joins:
        the one it joined before, else its parent's root; ``own`` names its thread there."""
        client = ctx.client_label
        if own is None:
            return self.roots.get((client, parent)) or parent
        root = self.roots.get((client, own))
        if root is None:
            root = self.roots.get((client, parent)) or parent
            self.roots.put((client, own), root)
        ctx.session_thread = own
        return root
