"""Stage 5, admit: keep each rank's active sessions within its KV pool budget.

Pass-through until session accounting lands: every request is admitted.
"""

from __future__ import annotations

from proxy.context import RequestContext


async def admit(ctx: RequestContext) -> None:
    """Return when ``ctx`` may proceed; raise ``ProxyError(429)`` when it may not."""
    return None
