"""Stage 3, canonicalize: make the system prompt and tools byte-stable across turns.

Runs the rule engine of ``proxy/canonical/`` over the API's chat-shaped view of the request (for
chat, the body itself) and maps the rewrites back into the API's own fields. What a rule remembers
per session (first-seen tool order, where moved date lines went) lives in the session's local state
(``proxy.state.local``). A request that no rule changes is forwarded as the client's own bytes. Off
globally with ``--no-canonicalize``, per request with the header ``x-prefixgate-canonicalize: off``.
"""

from __future__ import annotations

from typing import Any

from proxy.canonical import CanonicalConfig, Canonicalizer
from proxy.context import RequestContext
from proxy.ops.metrics import Metrics

OFF_HEADER = "x-prefixgate-canonicalize"
DEBUG_HEADER = "x-prefixgate-canonical-rewrites"


class Canonicalize:
    """Rewrites ``ctx.body`` into its canonical form when a rule applies (``ctx.body_changed``,
    ``ctx.rewrites``); does nothing when ``canonicalizer`` is None (off)."""

    def __init__(self, canonicalizer: Canonicalizer | None, metrics: Metrics) -> None:
        self.canonicalizer = canonicalizer
        self.metrics = metrics

    @classmethod
    def from_settings(cls, enabled: bool, config: dict[str, Any], metrics: Metrics) -> Canonicalize:
        canonicalizer = Canonicalizer(CanonicalConfig.model_validate(config)) if enabled else None
        return cls(canonicalizer, metrics)

    def __call__(self, ctx: RequestContext) -> None:
        canonicalizer = self.canonicalizer
        if canonicalizer is None or ctx.headers.get(OFF_HEADER, "").lower() == "off":
            return
        view = ctx.api.canon_view(ctx.body)
        if view is None:
            return
        result = canonicalizer.apply(
            view,
            api="chat",
            session=thread.canon if (thread := ctx.conversation) is not None else None,
            model=ctx.model,
            client_label=ctx.client_label,
        )
        if not result.changed:
            return
        ctx.rewrites = result.rewrites
        counter = self.metrics.canonical_rewrites
        for rule, count in result.rewrites.items():
            counter.labels(rule).inc(count)
        ctx.body = ctx.api.from_canon_view(ctx.body, view, result.body)
        ctx.body_changed = True


def rewrites_header(rewrites: dict[str, int]) -> str:
    """``rule=count`` pairs for the debug response header."""
    return ",".join(f"{rule}={count}" for rule, count in sorted(rewrites.items()))
