"""The one owner of what this process keeps per session between its turns.

Each stage that remembers something about a session hangs it off the session's ``SessionLocal``:
the dashboard the turn log, the prefix-break explainer the recent breaks, the Responses API the ids
the session's answers were stored under. A session holds *threads* (``ThreadLocal``, recognised by
``proxy.stages.identify``): its main conversation, side requests (a title generator, a topic check)
and sub-agents, each with its own prefix chain: the canonicalizer's first-seen tool order and pinned
text, the tokenizer's previous turn (tokens and block hashes), the explainer's previous turn, the
previous answer, and its own counts. ``SessionLocals`` bounds
them together: one count, one byte budget, one eviction (least recently used session first), and
ending a session (``end``) frees all of it at once.

Invariants: a ``SessionLocal`` is held by at most one ``SessionLocals`` entry (its ``key``); the
entry's charged cost equals ``SessionLocal.nbytes`` after every ``charge``; an evicted or ended
session's objects are no longer reachable from the owner (a request still holding it finishes on
its copy, and the next request of that session starts afresh).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.canonical import InMemorySessionCanonState
from tokenization.lru import LRU

#: Sessions remembered per process at most (least recently used dropped first).
DEFAULT_MAX_SESSIONS = 100_000
#: Approximate bytes all sessions' local state may hold together: previous turns' tokens and block
#: hashes dominate (~4 B a token, ~70 B a block), then the explainer's bodies.
DEFAULT_BUDGET_BYTES = 512 * 1024 * 1024
#: A session's entry before anything is attached: the object and its small slots.
_BASE_BYTES = 400
#: Response ids remembered per session (so that ending it forgets them); older ones are left to
#: the response map's own bound.
MAX_RESPONSE_IDS = 64
#: Threads remembered per session (the least recently seen one but the main thread goes first).
MAX_THREADS = 16
#: The main conversation's thread key.
MAIN = "main"


@dataclass(frozen=True, slots=True)
class Answer:
    """A thread's latest answered request: the rank, the prompt it was given, the tokens it wrote
    (the rank caches those blocks too: ``proxy.stages.blocks`` counts them in the next estimate)."""

    rank: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    """A prompt that carries the thread's previous answer back: the rank that generated it holds the
    prompt's first ``blocks`` blocks; ``kind`` (``text`` or ``tools``: the answer called tools) and
    whether the estimate counts them (``credited``: this thread's agent sends that kind of answer back
    as it was generated, as far as the ranks' reports have shown)."""

    rank: str
    blocks: int
    kind: str
    credited: bool


@dataclass(slots=True, eq=False)
class ThreadLocal:
    """One conversation inside a session: its prefix chain and what it has cost and hit."""

    key: str
    #: ``main``, ``side`` (a request beside the conversation) or ``subagent``.
    kind: str = "main"
    #: How it was recognised (``proxy.stages.identify``), and the start of its system prompt.
    source: str = "session"
    label: str = ""
    #: Whether it offered tools when it started (tells side requests from the main thread).
    tools: bool = False
    #: A sub-agent's parent thread (``main``, or another sub-agent's key), when the agent named it.
    parent: str = ""
    canon: InMemorySessionCanonState = field(default_factory=InMemorySessionCanonState)
    #: The tokenizer's previous turn (``tokenization.prompt``), and its bytes.
    prompt: Any = None
    prompt_bytes: int = 0
    #: The tokenizer that made ``prompt``: a memo is no base for another one.
    prompt_by: Any = None
    #: The blocks of a first turn still being tokenized (``RequestContext.landing``): the next turn
    #: awaits them, its base.
    landing: asyncio.Task[None] | None = None
    #: The prefix-break explainer's memory of the previous turn (``proxy.explain``), and its bytes.
    turn: Any = None
    turn_bytes: int = 0
    answer: Answer | None = None
    #: Per answer kind: does the agent send such answers back as generated (learnt from the ranks'
    #: reports; unknown counts as yes)? Agents re-serialize tool calls, some their arguments' JSON.
    verbatim: dict[str, bool] = field(default_factory=dict)
    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    estimated_cached_tokens: int = 0
    breaks: int = 0
    first_seen: float = 0.0
    last_seen: float = 0.0

    @property
    def nbytes(self) -> int:
        return 300 + self.prompt_bytes + self.turn_bytes

    def to_dict(self) -> dict[str, Any]:
        """The thread as the admin API and the dashboard show it."""
        sent = self.prompt_tokens
        return {
            "key": self.key,
            "kind": self.kind,
            "source": self.source,
            "label": self.label,
            "parent": self.parent,
            "requests": self.requests,
            "prompt_tokens_sent": sent,
            "hit_tokens_reported": self.cached_tokens,
            "hit_tokens_estimated": self.estimated_cached_tokens,
            "hit_rate": self.cached_tokens / sent if sent else None,
            "breaks": self.breaks,
            "first_seen": self.first_seen,
            "last_seen": self.last_seen,
        }


@dataclass(slots=True, eq=False)
class SessionLocal:
    """One session's state in this process. Slots are filled by the stages that own them."""

    key: str
    #: The session's threads by key, least recently seen first.
    threads: dict[str, ThreadLocal] = field(default_factory=dict)
    #: The newest prefix breaks (``proxy.explain`` records), oldest first.
    breaks: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=32))
    #: The dashboard's turn log (``proxy.ops.dashboard.stats.Turn``), oldest first.
    turns: deque[Any] = field(default_factory=lambda: deque(maxlen=100))
    #: Ids of answers the rank stored for this session (Responses), newest last.
    response_ids: deque[str] = field(default_factory=lambda: deque(maxlen=MAX_RESPONSE_IDS))

    @property
    def nbytes(self) -> int:
        """Approximate memory held: the threads' tokenizer and explainer turns dominate."""
        threads = sum(t.nbytes for t in self.threads.values())
        return _BASE_BYTES + threads + 160 * (len(self.breaks) + len(self.turns))

    @property
    def last_seen(self) -> float:
        """When any of its threads last had a request (wall clock; 0 before the first)."""
        return max((t.last_seen for t in self.threads.values()), default=0.0)

    @property
    def main(self) -> ThreadLocal:
        """The main conversation's thread (opened when missing)."""
        return self.thread(MAIN)

    def thread(self, key: str, **new: Any) -> ThreadLocal:
        """The thread ``key``, now the most recently seen; created with ``new``'s fields when missing
        (the least recently seen thread but the main one goes when the session holds too many)."""
        found = self.threads.pop(key, None)
        if found is None:
            found = ThreadLocal(key, **new)
            if len(self.threads) >= MAX_THREADS:
                oldest = next((k for k in self.threads if k != MAIN), None)
                if oldest is not None:
                    del self.threads[oldest]
        self.threads[key] = found
        return found


class SessionLocals:
    """Every session's ``SessionLocal``, bounded together (see the module docstring)."""

    def __init__(
        self,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        budget_bytes: int = DEFAULT_BUDGET_BYTES,
        on_evict: Callable[[SessionLocal], None] | None = None,
    ) -> None:
        """``on_evict``: told of each session dropped to make room (not of sessions ended)."""
        self._lru: LRU[str, SessionLocal] = LRU(
            budget_bytes,
            max_entries=max_sessions,
            on_evict=None if on_evict is None else lambda _key, local: on_evict(local),
        )

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def nbytes(self) -> int:
        return self._lru.nbytes

    @property
    def budget_bytes(self) -> int:
        return self._lru.budget_bytes

    def get(self, key: str) -> SessionLocal | None:
        """The session's state, if this process holds it (no use counted: a read)."""
        return self._lru.peek(key)

    def open(self, key: str) -> SessionLocal:
        """The session's state for its next request (created empty on its first), now the most
        recently used."""
        local = self._lru.get(key)
        if local is None:
            local = SessionLocal(key)
            self._lru.put(key, local, local.nbytes)
        return local

    def values(self) -> list[SessionLocal]:
        """Every session's state, least recently used first (a copy)."""
        return list(self._lru.values())

    def charge(self, local: SessionLocal) -> None:
        """Re-count ``local``'s bytes after a stage attached or replaced something (may evict others,
        or ``local`` itself when it alone exceeds the budget)."""
        if self._lru.peek(local.key) is local:
            self._lru.recost(local.key, local.nbytes)

    def end(self, key: str) -> SessionLocal | None:
        """Forget the session's state at once (it ended); what was held, if anything."""
        return self._lru.pop(key)

    def stats(self) -> dict[str, int]:
        return self._lru.stats()
