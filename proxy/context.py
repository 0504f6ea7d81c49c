"""The typed record a request carries through the pipeline, and what its answer was.

Stages fill in their fields in pipeline order (``proxy/pipeline.py``); a stage reads only what the
stages before it wrote. ``body`` is always the client's request in its own API (canonicalization
may replace it with the canonical form); ``prompt`` is the separate view the rank renders into
tokens (the chat-completions body vLLM converts an agent API's request into).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson
from starlette.datastructures import Headers

from proxy.stages.splice import upstream_bytes

if TYPE_CHECKING:
    from proxy.admission import Admitted
    from proxy.apis.base import Api
    from proxy.explain import Expectation
    from proxy.ops.auth import ClientKey
    from proxy.stages.route import RoutePlan
    from proxy.stages.usage import Usage
    from proxy.state.local import CachedAnswer, SessionLocal, ThreadLocal
    from routing.ranks import Rank
    from tokenization.prompt_blocks import PromptBlocks


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
    # -- threads: the conversation of the session this request continues (``proxy.stages.threads``)
    thread: ThreadLocal | None = None
    #: The body as parsed, the one ``raw_body`` encodes (``body`` until canonicalization replaces it).
    client_body: dict[str, Any] | None = None
    # -- canonicalize: when a rule rewrites ``body`` it sets ``body_changed`` and forwarding sends
    # the client's bytes with the changed values re-serialized; otherwise the bytes untouched.
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
    #: could not be rendered, none). The observers learn from the request once it is done.
    landing: asyncio.Task[None] | None = None
    #: ``landing`` is a returning turn's short tail, encoded on the event loop while the request waits
    #: for its rank: it lands before the answer starts (``Blocks.settle``).
    landing_on_loop: bool = False
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

    def upstream_body(self) -> bytes:
        """The bytes sent to the rank: the client's own, with what canonicalization changed
        re-serialized in place (``proxy/stages/splice.py``), or the whole body when that cannot be."""
        if not self.body_changed:
            return self.raw_body
        if self.client_body is not None:
            return upstream_bytes(self.raw_body, self.client_body, self.body)
        return orjson.dumps(self.body)


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a routed request ended, as the observers (``proxy/stages/observe.py``) see it."""

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


#: Status logged (and counted) for a request whose client went away: nginx's convention.
CLIENT_CLOSED = 499
