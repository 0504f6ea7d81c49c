"""The refusals admission answers: 429s naming what is full and when to come back, and the 400 for a
prompt no rank can hold."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from proxy.errors import ProxyError, too_many_requests
from proxy.state.sessions import Session

log = logging.getLogger("prefixgate.admission")


def client_at_cap(
    client: str, cap: int, active: Iterable[Session], now: float, idle_ttl: float, key: str | None = None
) -> ProxyError | None:
    """The 429 for a client key that already has ``cap`` active sessions (other than ``key``, the
    session asking), or None."""
    mine = [s.last_seen for s in active if s.client == client and s.key != key]
    if len(mine) < cap:
        return None
    idle_at = min(mine, default=now)
    return too_many_requests(
        f"client {client!r} already has {len(mine)} active sessions (its limit is {cap}); "
        "end one (DELETE /admin/sessions/{id}) or let one idle out",
        "too_many_sessions",
        idle_at + idle_ttl - now,
    )


def queue_full(waiting: int, retry_after: float) -> ProxyError:
    """The 429 when ``waiting`` sessions already wait for a seat (``--admission-queue``)."""
    log.warning("429: %d sessions already wait for a seat, the queue's limit", waiting)
    return too_many_requests(
        f"{waiting} sessions already wait for a seat on a rank, the most this proxy holds "
        "(--admission-queue); retry later",
        "admission_queue_full",
        retry_after,
    )


def context_too_long(tokens: int, limit: int) -> ProxyError:
    """The 400 for a prompt larger than any rank can hold (its ``max_model_len`` or its KV pool)."""
    return ProxyError(
        400,
        f"This prompt is {tokens} tokens; the largest any rank can hold is {limit} tokens "
        "(its maximum context length or its KV cache). Please reduce the length of the messages.",
        code="context_length_exceeded",
        param="messages",
    )
