"""Stage 2b, threads: which conversation inside the session this request belongs to.

Agents send more than their main conversation under one session id: opencode a title generator
("You are a title generator...") before the conversation, Claude Code small-model checks and
compaction summaries, and sub-agents (its Agent/Task tool) that run whole conversations of their
own. Each is a thread of the session (``proxy.state.local.ThreadLocal``) with its own prefix chain,
so a side request is never a break of the main conversation. The session's rank serves every
thread (routing is by session), and sub-agents share the system + tools head with each other.

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

After the answer (``finished``) the thread counts what it sent and hit, and remembers the answer
(its rank and length) for the next estimate (``proxy.stages.blocks``). Whether an agent sends its
answers back as generated (per kind: text, tool calls) is learnt from the ranks' reports and shared
by the threads of one system prompt identity, across sessions: one agent's sessions learn it once.
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
