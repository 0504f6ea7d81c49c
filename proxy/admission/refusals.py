"""The 429s admission answers, each naming what is full and when to come back."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from proxy.admission.accounting import RankState
from proxy.admission.config import AdmissionConfig
from proxy.errors import ProxyError, too_many_requests
from proxy.state.sessions import Session

log = logging.getLogger("prefixgate.admission")


def client_at_cap(
    client: str, cap: int, active: Iterable[Session], now: float, idle_ttl: float
) -> ProxyError | None:
    """The 429 for a client key that already has ``cap`` active sessions, or None."""
    mine = [s.last_seen for s in active if s.client == client]
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
    tokens: int, states: dict[str, RankState], config: AdmissionConfig, now: float
) -> tuple[str, ProxyError]:
    """(reason, the 429) for a new session of ``tokens`` that found no rank with room in time."""
    waits = [s.next_idle_at - now for s in states.values() if s.next_idle_at is not None]
    retry_after = min(waits) if waits else config.idle_ttl
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
        f"{config.wait:g} s: every rank's active sessions fill its KV cache budget "
        f"({config.target_fraction:g} of its pool) or its session limit ({summary})",
        "admission_" + reason,
        retry_after,
    )
