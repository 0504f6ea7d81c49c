"""The refusals admission answers: 429s naming what is full and when to come back, and the 400 for a
prompt no rank can hold."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from proxy.admission.accounting import RankState
from proxy.admission.config import AdmissionConfig
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


def no_room(
    tokens: int, states: dict[str, RankState], config: AdmissionConfig, now: float, wait_s: float
) -> tuple[str, ProxyError]:
    """(reason, the 429) for a new session of ``tokens`` that found no rank with room within
    ``wait_s`` seconds."""
    waits = [s.next_idle_at - now for s in states.values() if s.next_idle_at is not None]
    retry_after = min(waits) if waits else wait_s
    budget_full = any(s.budget_tokens is not None for s in states.values())
    reason = "pool_full" if budget_full else "rank_sessions"
    summary = ", ".join(
        f"{s.name} {s.projected_tokens}/{s.budget_tokens} tokens as its sessions grow "
        f"({s.working_set_tokens} now), {s.sessions} sessions"
        for s in states.values()
    )
    log.info("429: no rank has room for a new session of %d tokens (%s)", tokens, summary)
    return reason, too_many_requests(
        f"no rank has room for a new session of {tokens} prompt tokens after waiting "
        f"{wait_s:g} s: every rank's active sessions fill its KV cache budget "
        f"({config.target_fraction:g} of its pool) or its session limit ({summary})",
        "admission_" + reason,
        retry_after,
    )


def overloaded(tokens: int, retry_after: float) -> ProxyError:
    """The 429 when every rank's queue is saturated: waiting for room would not help."""
    log.info("429: every rank's prefill queue is saturated (a new session of %d tokens)", tokens)
    return too_many_requests(
        f"every rank's prefill queue is saturated: a new session of {tokens} prompt tokens would wait "
        f"about {retry_after:.0f} s behind it; retry later",
        "admission_overload",
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
