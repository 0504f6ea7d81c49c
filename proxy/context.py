"""The request's records: the context it carries through the pipeline, what the stages hand each other
on it, and how it ended.

Stages fill in the context's fields in pipeline order (``proxy/pipeline.py``); a stage reads only what
the stages before it wrote. ``body`` is always the client's request in its own API (canonicalization
may replace it with the canonical form); ``prompt`` is the separate view the rank renders into
tokens (the chat-completions body vLLM converts an agent API's request into).

The records the stages exchange live here too, so that every stage can name them without importing
another stage: admission's answer (``Admitted``, its ``Seat`` and the session's record ``Before`` it),
the route's plan (``RoutePlan``), the explainer's ``Expectation``, and the ``Outcome``. This module
is the bottom of ``proxy/``: what it names for types only is below it too (the APIs, the session
state, the ranks, the prompt's blocks) and imports nothing of the pipeline.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.datastructures import Headers

from proxy.errors import CLIENT_CLOSED

if TYPE_CHECKING:
    from proxy.apis.base import Api, Usage
    from proxy.ops.auth import ClientKey
    from proxy.state.local import CachedAnswer, SessionLocal, ThreadLocal
    from proxy.state.sessions import Session
    from routing.ranks import Rank
    from tokenization.prompt import PromptBlocks


@dataclass(frozen=True, slots=True)
class Seat:
    """A new (or returning) session's seat, as admission grants it."""

    #: ``room`` (within a budget as it stood), ``released`` (once sessions judged ended give up
    #: theirs) or ``rotated`` (once quiet residents were parked for it).
    decision: str
    #: The ranks it may go to (the router picks among them).
    allowed: frozenset[str]
    #: Per allowed rank, the sessions judged ended that release their seats if it goes there.
    victims: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: The sessions parked for it, and on which rank (``rotated``).
    parked_rank: str | None = None
    parked: tuple[str, ...] = ()

    @property
    def reason(self) -> str:
        if self.decision == "rotated":
            return (
                f"{len(self.parked)} quiet session(s) parked on {self.parked_rank} after the rotation bound"
            )
        if self.decision == "released":
            return "room once sessions quiet past their think times give up their seats"
        return "room within the budget"


@dataclass(frozen=True, slots=True)
class Before:
    """What admission changes of a session's record for one request, as it stood before."""

    turns: int
    context_tokens: int
    context_blocks: int
    head_key: str | None
    head_tokens: int
    last_seen: float
    answered_at: float
    rank: str | None
    released: bool

    @classmethod
    def of(cls, session: Session) -> Before:
        return cls(
            session.turns,
            session.context_tokens,
            session.context_blocks,
            session.head_key,
            session.head_tokens,
            session.last_seen,
            session.answered_at,
            session.rank,
            session.released,
        )

    def restore_turn(self, session: Session) -> None:
        """The request failed: its turn and its growth no longer count; the session stays where it
        was, with nothing in flight."""
        session.turns = self.turns
        session.context_tokens, session.context_blocks = self.context_tokens, self.context_blocks
        session.head_key, session.head_tokens = self.head_key, self.head_tokens
        session.answered_at = session.last_seen

    def restore_all(self, session: Session) -> None:
        """A session admitted anew by a request that failed: back to how it had ended."""
        self.restore_turn(session)
        session.last_seen, session.answered_at = self.last_seen, self.answered_at
        session.rank, session.released = self.rank, self.released


@dataclass(frozen=True, slots=True)
class Admitted:
    """Admission's answer for one request (``proxy/admission``): its session's record, and where it
    may go."""

    #: The session's record (None: the request has no session key, nothing is accounted).
    session: Session | None = None
    #: The ranks a new (or re-homed) session may go to; None: any.
    allowed: frozenset[str] | None = None
    #: The rank the session is accounted on: the router keeps it there unless it is down or saturated.
    home: str | None = None
    #: The session's record before this request (put back if it fails); None: this request made it.
    before: Before | None = None
    #: This request admitted the session anew (new, or back after ending).
    fresh: bool = False
    #: The seat that admitted it anew (None: active, homed, or admission off).
    seat: Seat | None = None
    waited_s: float = 0.0


@dataclass(slots=True)
class RoutePlan:
    """The ranks to try, best first (``proxy/stages/route.py``), and what is charged to the one
    currently holding the request."""

    ranks: list[Rank]
    #: The rank charged with this request's prefill and prompt tokens (None once released).
    charged: str | None = None
    prefill: int = 0
    tokens: int = 0
    #: The prompt's full blocks when it was charged (a turn routed on its head: the head's).
    blocks: int = 0
    #: The charged rank's stream opened (its first token came): its prefill left the queue already.
    prefilled: bool = False
    #: The blocks recorded in flight on the charged rank (fed by KV events) until its prefill.
    inflight_blocks: list[Sequence[bytes]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Expectation:
    """A routed turn awaiting the rank's answer: what it should hit if the rank kept the prefix (the
    prefix-break explainer's, ``proxy/explain``)."""

    turn: int
    expected_tokens: int  # tokens of the prefix shared with the previous turn, whole hittable blocks
    num_tokens: int  # the prompt's tokens as prefixgate counted them
    block_size: int
    rank: str | None
    previous_rank: str | None


@dataclass(slots=True)
class RequestContext:
    """One client request."""

    api: Api
    headers: Headers
    raw_body: bytes
    #: The client's request in its own API (after canonicalization: its canonical form).
    body: dict[str, Any]
    stream: bool
    model: str | None
    started: float
    #: The client's API key (``proxy/ops/auth.py``: its label and limits, never the key itself);
    #: None when client keys are not configured.
    client: ClientKey | None = None
    # -- identify session
    session_key: str | None = None
    session_source: str | None = None
    #: The client says this is the session's last request (``identify.SESSION_END_HEADERS``): its
    #: seat is freed once it is answered.
    session_ends: bool = False
    #: The request's priority class for a seat (``identify.PRIORITY_HEADER``, capped by what its
    #: client key was granted; the key's own priority without the header; 0 without client keys).
    priority: int = 0
    #: A child session's own id when it joined its parent's session (``proxy.stages.identify``): it
    #: names the child's thread there.
    session_thread: str | None = None
    #: What this process keeps for the session between its turns (``proxy/state/local.py``).
    local: SessionLocal | None = None
    # -- threads: the conversation of the session this request continues (``proxy.stages.identify``)
    thread: ThreadLocal | None = None
    #: The body as parsed, the one ``raw_body`` encodes (``body`` until canonicalization replaces it).
    client_body: dict[str, Any] | None = None
    # -- canonicalize: when a rule rewrites ``body`` it sets ``body_changed`` and forwarding sends
    # the client's bytes with the changed values re-serialized; otherwise the bytes untouched
    # (``proxy.stages.canonicalize.upstream_body``).
    body_changed: bool = False
    rewrites: dict[str, int] | None = None  # rule -> count, when canonicalization changed the body
    # -- render and hash blocks
    #: The body the rank renders (``Api.prompt_view``); None: not the whole prompt.
    prompt: dict[str, Any] | None = None
    prompt_tokens: int | None = None
    block_hashes: Sequence[bytes] = ()
    prompt_blocks: PromptBlocks | None = None
    #: A turn routed on its head or on the blocks it keeps of its previous turn
    #: (``proxy.stages.blocks``): the whole prompt's tokenizing and hashing, off the request's path.
    #: Until it is done, ``prompt_blocks`` and ``block_hashes`` are the head's (or the kept blocks)
    #: and ``prompt_tokens`` an estimate from the prompt's text; then the whole prompt's (or, when it
    #: could not be rendered, none). What learns from answers is told once it is done.
    landing: asyncio.Task[None] | None = None
    #: ``landing`` is a returning turn's short tail, encoded on the event loop while the request waits
    #: for its rank: it lands before the answer starts (``Blocks.settle``).
    landing_on_loop: bool = False
    #: The request was answered before ``landing`` was done: its outcome, set when it ends, is told
    #: once the prompt has landed (``Pipeline._after_landing``).
    ending: asyncio.Future[Outcome] | None = None
    #: The thread's previous answer carried back in this prompt, and the blocks its rank then holds
    #: (``proxy.stages.blocks``); the router counts them when ``credited``.
    cached_answer: CachedAnswer | None = None
    # -- admit: the session's record, and where it may go (``proxy/admission``)
    admitted: Admitted | None = None
    # -- route: the ranked candidates and what the chosen one should hit
    plan: RoutePlan | None = None
    #: The prompt tokens prefixgate expects the chosen rank to find in its prefix cache (None when
    #: the prompt's blocks are unknown).
    estimated_cached_tokens: int | None = None
    #: Of those, the tokens of blocks the rank holds in CPU memory only (KV offloading: it loads
    #: them back instead of prefilling; vLLM counts them in its cached tokens).
    estimated_cpu_tokens: int | None = None
    #: What the session's previous turn says this one should hit (the prefix-break explainer's).
    expectation: Expectation | None = None
    # -- forward: the rank that answered, and how many ranks were tried
    rank: Rank | None = None
    attempts: int = 0

    @property
    def conversation(self) -> ThreadLocal | None:
        """The thread whose prefix chain this request extends: ``thread``, else (no thread stage ran)
        the session's main thread; None without a session."""
        if self.thread is not None:
            return self.thread
        return self.local.main if self.local is not None else None

    @property
    def client_label(self) -> str | None:
        return self.client.label if self.client is not None else None


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a routed request ended, as the pipeline's ending tells it (``proxy/pipeline.py``)."""

    ctx: RequestContext
    #: The rank that answered, or None when none did (every attempt failed, or the client left first).
    rank: str | None
    #: The HTTP status relayed to the client (499: the client went away).
    status: int
    #: What the rank reported (None: it did not say, or the answer was not a success).
    usage: Usage | None = None
    #: The id of the answer the rank stored (Responses), when it said.
    stored_id: str | None = None
    #: Why a stream broke or the request failed, if it did.
    error: str | None = None

    @property
    def answered(self) -> bool:
        """A rank answered and the client got the answer (a finished stream, or a whole body)."""
        return self.rank is not None and self.status != CLIENT_CLOSED
