"""Stage 3, canonicalize: make the system prompt and tools byte-stable across turns.

Pass-through until the canonicalizer (``proxy/canonical/``) is wired in: the body is forwarded
exactly as the client sent it.
"""

from __future__ import annotations

from proxy.context import RequestContext


def canonicalize(ctx: RequestContext) -> None:
    """Rewrite ``ctx.body`` in place when a rule applies, setting ``ctx.body_changed``."""
    return None
