"""Stage 3, canonicalize: make the system prompt and tools byte-stable across turns.

Runs the rule engine of ``proxy/canonical/`` over chat requests. What it needs to remember per
session (first-seen tool order, where moved date lines went) lives in a bounded LRU here; a request
that no rule changes is forwarded as the client's own bytes. Off globally with
``--no-canonicalize``, per request with the header ``x-prefixgate-canonicalize: off``.
"""

from __future__ import annotations

from proxy.canonical import CanonicalConfig, Canonicalizer, InMemorySessionCanonState
from proxy.context import ApiKind, RequestContext
from proxy.metrics import Metrics
from tokenization.lru import LRU

OFF_HEADER = "x-prefixgate-canonicalize"
DEBUG_HEADER = "x-prefixgate-canonical-rewrites"


class SessionCanonStates:
    """Per-session canonicalization state, least recently used sessions dropped past ``capacity``."""

    def __init__(self, capacity: int = 100_000) -> None:
        self._states: LRU[str, InMemorySessionCanonState] = LRU(capacity)

    def get(self, session_key: str) -> InMemorySessionCanonState:
        """The session's state, created empty on its first request."""
        state = self._states.get(session_key)
        if state is None:
            state = InMemorySessionCanonState()
            self._states.put(session_key, state)
        return state


class CanonStage:
    def __init__(
        self, canonicalizer: Canonicalizer | None, metrics: Metrics, states: SessionCanonStates
    ) -> None:
        self.canonicalizer = canonicalizer
        self.metrics = metrics
        self.states = states

    @classmethod
    def from_settings(cls, enabled: bool, config: dict, metrics: Metrics) -> CanonStage:
        canonicalizer = Canonicalizer(CanonicalConfig.model_validate(config)) if enabled else None
        return cls(canonicalizer, metrics, SessionCanonStates())

    def enabled_for(self, ctx: RequestContext) -> bool:
        """Whether canonicalization is on globally and not turned off by the request's header."""
        return self.canonicalizer is not None and ctx.headers.get(OFF_HEADER, "").lower() != "off"

    def rewrite(self, ctx: RequestContext, chat: dict) -> dict | None:
        """The canonical form of the chat-shaped ``chat`` (``ctx.body`` or an API's chat view), or None
        when no rule changes it; sets ``ctx.rewrites`` and counts the rewrites. Call when ``enabled_for``."""
        assert self.canonicalizer is not None
        state = self.states.get(ctx.session_key) if ctx.session_key else None
        result = self.canonicalizer.apply(
            chat, api="chat", session=state, model=ctx.model, client_label=ctx.client_label
        )
        if not result.changed:
            return None
        ctx.rewrites = result.rewrites
        counter = self.metrics.canonical_rewrites
        for rule, count in result.rewrites.items():
            counter.labels(rule).inc(count)
        return result.body

    def __call__(self, ctx: RequestContext) -> None:
        """Rewrite ``ctx.body`` when a rule applies, setting ``ctx.body_changed`` and ``ctx.rewrites``."""
        if ctx.api is not ApiKind.CHAT or not self.enabled_for(ctx):
            return
        body = self.rewrite(ctx, ctx.body)
        if body is not None:
            ctx.body = body
            ctx.body_changed = True


def rewrites_header(rewrites: dict[str, int]) -> str:
    """``rule=count`` pairs for the debug response header."""
    return ",".join(f"{rule}={count}" for rule, count in sorted(rewrites.items()))
