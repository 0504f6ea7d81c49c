"""Stage 2, identify: which session this request continues, and which conversation inside it.

The session (``Identify``). In order: a parent session header (``PARENT_SESSION_HEADERS``: a
sub-agent that its agent runs as a child session, opencode's ``x-parent-session-id``) joins the
parent's session, and the child's own session id names its thread there
(``RequestContext.session_thread``); then the first configured session header present; then body
fields agents set (``prompt_cache_key``, ``metadata.session_id``, ``metadata.user_id``, ``user``);
else a fingerprint of the requested model and the conversation's stable head (system, tools, first
user message, as the API names them): the same agent task re-sends the same head to the same model
every turn, and two conversations that open alike ("hi") with different models are different
sessions. The session's local state (``proxy.state.local``) is opened for
the thread and the stages after this one.

A child of a child (a sub-agent's sub-agent) joins the session its parent joined, as far as this
process saw the parent; each child keeps the session it was first given, so none is ever split.

The key is made safe (``proxy.tenants.safe_key``: printable ASCII, bounded) and, with client keys
configured, namespaced by the client's key: one client can never continue another's session.

The thread (``Threads``). Agents send more than their main conversation under one session id:
opencode a title generator ("You are a title generator...") before the conversation, Claude Code
small-model checks and compaction summaries, and sub-agents (its Agent/Task tool) that run whole
conversations of their own. Each is a thread of the session (``proxy.state.local.ThreadLocal``) with
its own prefix chain, so a side request is never a break of the main conversation. The session's
rank serves every thread (routing is by session), and sub-agents share the system + tools head with
each other.

Recognised from the agents' own signals, in order:

1. a child session that joined its parent's session (``RequestContext.session_thread``, opencode's
   ``x-parent-session-id``), then a thread header (``x-prefixgate-thread``, or an agent id header an
   agent sends: Claude Code's ``x-claude-code-agent-id``, Codex's ``thread-id`` when it is not the
   session's own id): that thread, a sub-agent. Its parent (``PARENT_THREAD_HEADERS``: Claude Code's
   ``x-claude-code-parent-agent-id``, Codex's ``x-codex-parent-thread-id``; the parent session of a
   child session) is recorded on it: the main thread, or another sub-agent;
2. a side request header (``SIDE_HEADERS``: Claude Code's ``x-claude-code-auxiliary-type``): a side
   thread per kind;
3. no main thread yet: the request starts it, unless its system prompt is a known side request's
   (``SIDE_IDENTITIES``);
4. the main thread offers tools and this request offers none: a side request, one thread per
   system prompt identity (its first line);
5. it offers tools under another system prompt identity than the main thread's: a sub-agent, one
   thread per identity and first user message;
6. otherwise the main conversation (its edits, compactions and tool changes are breaks of it).

After the answer (``Threads.finished``) the thread counts what it sent and hit, and remembers the
answer (its rank and length) for the next estimate (``proxy.stages.blocks``). Whether an agent sends
its answers back as generated (per kind: text, tool calls) is learnt from the ranks' reports and
shared by the threads of one system prompt identity, across sessions: one agent's sessions learn it
once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import orjson
import xxhash

from proxy.context import Outcome, RequestContext
from proxy.state.local import MAIN, Answer, SessionLocal, SessionLocals
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


# -- the thread: which conversation of the session the request belongs to

#: Headers naming the thread (a sub-agent's id) when an agent or a client sends one.
DEFAULT_THREAD_HEADERS: tuple[str, ...] = (
    "x-prefixgate-thread",
    "x-claude-code-agent-id",
    "x-agent-id",
    "thread-id",
)
#: Headers naming the parent of a sub-agent (a thread of the session, or the session itself).
PARENT_THREAD_HEADERS: tuple[str, ...] = ("x-claude-code-parent-agent-id", "x-codex-parent-thread-id")
#: Headers marking a side request, valued by its kind: Claude Code's memory extraction
#: (``memory_save``), which runs beside the conversation with its own prompt.
SIDE_HEADERS: tuple[str, ...] = ("x-claude-code-auxiliary-type",)
#: Starts of the system prompts of known side requests (recognised even before the main thread).
SIDE_IDENTITIES: tuple[str, ...] = ("You are a title generator",)
#: Lines that identify no agent (attribution that changes per session or request).
_SKIPPED_LINES = ("x-anthropic-billing-header:",)
#: Characters of the system prompt's first line kept as its identity and label.
IDENTITY_CHARS = 120
#: System prompt identities whose answer habits are remembered (least recently used out first).
LEARNT_IDENTITIES = 4096


def system_texts(system: Any, head_messages: Any) -> Iterator[str]:
    """The system prompt's texts, in order: the API's system field, else the leading system messages."""
    if system is None and isinstance(head_messages, list):
        roles = ("system", "developer")
        system = [m.get("content") for m in head_messages if isinstance(m, dict) and m.get("role") in roles]
    if isinstance(system, str):
        yield system
    elif isinstance(system, list):
        for part in system:
            if isinstance(part, str):
                yield part
            elif isinstance(part, dict) and isinstance(part.get("text"), str):
                yield part["text"]
            elif isinstance(part, list):
                yield from system_texts(part, None)


def identity(text: str) -> str:
    """The system prompt's identity: its first line that is not attribution, cut short (the text is
    scanned line by line from the start, never split whole: system prompts run to 60 kB)."""
    start = 0
    while start < len(text):
        end = text.find("\n", start)
        end = len(text) if end == -1 else end
        line = text[start : min(end, start + 4 * IDENTITY_CHARS)].strip()
        if line and not line.startswith(_SKIPPED_LINES):
            return line[:IDENTITY_CHARS]
        start = end + 1
    return ""


def _digest(*parts: Any) -> str:
    return xxhash.xxh3_64_hexdigest(orjson.dumps(parts, option=orjson.OPT_NON_STR_KEYS))


class Threads:
    """Sets ``ctx.thread``; after the answer, counts it on the thread."""

    def __init__(
        self,
        locals_: SessionLocals,
        headers: Sequence[str] = DEFAULT_THREAD_HEADERS,
        side_identities: Sequence[str] = SIDE_IDENTITIES,
    ) -> None:
        self.locals = locals_
        self.headers = tuple(headers)
        self.side_identities = tuple(side_identities)
        #: Per system prompt identity: does that agent send answers back as generated, per kind.
        self.verbatim: LRU[str, dict[str, bool]] = LRU(LEARNT_IDENTITIES)

    def __call__(self, ctx: RequestContext) -> None:
        local = ctx.local
        if local is None:
            return
        key, fields = self.recognise(ctx, local)
        thread = local.thread(key, **fields)
        now = time.time()
        if not thread.first_seen:
            thread.first_seen = now
            habits = self.verbatim.get(thread.label)
            if habits is None:
                habits = {}
                self.verbatim.put(thread.label, habits)
            thread.verbatim = habits  # shared: what one session learns, the next one knows
        thread.last_seen = now
        ctx.thread = thread

    def recognise(self, ctx: RequestContext, local: SessionLocal) -> tuple[str, dict[str, Any]]:
        """The thread key of ``ctx`` in ``local`` and, should it be new, its fields."""
        head = ctx.api.head(ctx.body)
        system, first, tools = head if isinstance(head, list) and len(head) == 3 else (None, None, None)
        name = next((found for text in system_texts(system, first) if (found := identity(text))), "")
        has_tools = bool(tools)
        named = self.named_thread(ctx)
        if named is not None:
            value, source, parent = named
            fields = {
                "kind": "subagent",
                "source": source,
                "label": name,
                "tools": has_tools,
                "parent": parent,
            }
            return f"agent:{value}", fields
        side = next(((h, v) for h in SIDE_HEADERS if (v := ctx.headers.get(h))), None)
        if side is not None:  # the agent says it is a side request, and of which kind
            fields = {"kind": "side", "source": f"header:{side[0]}", "label": name}
            return f"side:{_digest(side[0], side[1])}", fields
        main = local.threads.get(MAIN)
        if main is None:
            if name.startswith(self.side_identities):
                return f"side:{_digest(name)}", {"kind": "side", "source": "system identity", "label": name}
            return MAIN, {"kind": "main", "source": "first request", "label": name, "tools": has_tools}
        if main.tools and not has_tools:
            return f"side:{_digest(name)}", {"kind": "side", "source": "no tools", "label": name}
        if has_tools and name != main.label and main.label:
            fields = {"kind": "subagent", "source": "system identity", "label": name, "tools": True}
            return f"agent:{_digest(name, first)}", fields
        return MAIN, {"kind": "main", "source": "first request", "label": name, "tools": has_tools}

    def named_thread(self, ctx: RequestContext) -> tuple[str, str, str] | None:
        """The sub-agent a request names, how, and its parent thread's key: (id, source, parent)."""
        if ctx.session_thread is not None:  # Identify keyed it by its parent session header
            source = ctx.session_source or "session"
            parent = ctx.headers.get(source.removeprefix("header:"))
            return ctx.session_thread, source, self._thread_of(ctx, parent)
        for header in self.headers:
            value = ctx.headers.get(header)
            if value and not self._is_session(ctx, value):
                parent = next((v for h in PARENT_THREAD_HEADERS if (v := ctx.headers.get(h))), None)
                return value, f"header:{header}", self._thread_of(ctx, parent)
        return None

    @staticmethod
    def _is_session(ctx: RequestContext, value: str) -> bool:
        """Whether ``value`` is the session's own id (as Identify keys it: made safe, per client)."""
        return tenant_key(ctx.client_label, safe_key(value)) == ctx.session_key

    def _thread_of(self, ctx: RequestContext, parent: str | None) -> str:
        """The thread key of a parent id: the main thread when it is the session's own id (or none)."""
        return MAIN if not parent or self._is_session(ctx, parent) else f"agent:{parent}"

    def finished(self, outcome: Outcome) -> None:
        ctx = outcome.ctx
        thread = ctx.thread
        if thread is None:
            return
        if not outcome.answered:  # no answer known to have been generated whole: nothing to extend
            thread.answer = None
            return
        thread.requests += 1
        usage = outcome.usage
        if usage is None:
            thread.answer = None
            return
        thread.prompt_tokens += usage.prompt_tokens
        thread.cached_tokens += usage.cached_tokens or 0
        thread.estimated_cached_tokens += ctx.estimated_cached_tokens or 0
        self._learn(ctx, usage.cached_tokens)
        rank = outcome.rank
        if rank is not None and ctx.prompt_tokens == usage.prompt_tokens:
            thread.answer = Answer(rank, usage.prompt_tokens, usage.completion_tokens)
        else:  # the rank counted another prompt: its tokens are not ours, nothing to extend
            thread.answer = None

    @staticmethod
    def _learn(ctx: RequestContext, cached: int | None) -> None:
        """Whether the agent sent the previous answer back as generated, from what the rank hit: less
        than a credited estimate (the answer's blocks were not there), or all of an uncredited one."""
        answered, estimate, blocks = ctx.cached_answer, ctx.estimated_cached_tokens, ctx.prompt_blocks
        thread = ctx.thread
        if answered is None or cached is None or estimate is None or blocks is None or thread is None:
            return
        if answered.credited and cached < estimate:
            thread.verbatim[answered.kind] = False
        elif not answered.credited and cached >= answered.blocks * blocks.block_size:
            thread.verbatim[answered.kind] = True
