"""Each admission decision, said: the record kept on the session (``/admin/sessions/{id}``, the
dashboard) and the metrics counted for it.

A record names the decision (``room``, ``released``, ``rotated``; ``parked`` when the session gave
up its seat for a waiter), why, how long the session waited, whether it resumed after a park or an
end, the rotation bound and idle TTL in force, and the ranks it was allowed. ``placed`` adds the
rank the router picked.
"""

from __future__ import annotations

import logging
from typing import Any

from proxy.context import Seat
from proxy.ops.metrics import Metrics
from proxy.state.sessions import Session
from proxy.tenants import shown_to

log = logging.getLogger("prefixgate.admission")


def _round(value: float | None, digits: int = 4) -> float | None:
    return round(value, digits) if value is not None else None


def decision_record(
    seat: Seat | None,
    decision: str,
    reason: str,
    *,
    at: float,
    waited_s: float,
    bound_s: float,
    idle_ttl_s: float,
    resumed: bool = False,
    owner: str | None = None,
) -> dict[str, Any]:
    """What ``/admin/sessions/{id}`` shows of the latest decision for a session."""
    return {
        "at": at,
        "decision": decision,
        "reason": reason,
        "resumed": resumed,
        "waited_s": round(waited_s, 4),
        "wait_bound_s": _round(bound_s),
        "idle_ttl_s": _round(idle_ttl_s),
        "allowed": sorted(seat.allowed) if seat is not None else None,
        "parked": [shown_to(key, owner).removeprefix("session ") for key in seat.parked] if seat else [],
        "rank": None,
    }


def note_placed(session: Session, rank: str) -> None:
    """The router picked ``rank`` for a session just seated: record it, and say it in one sentence
    (once the rank is known, so the line names the one it went to)."""
    record = session.admission
    if record is None or record.get("rank") is not None:
        return
    record["rank"] = rank
    if log.isEnabledFor(logging.INFO):
        log.info(
            "session %s %s on %s after waiting %.3f s (rotation bound %.3g s): %s",
            session.key,
            "resumed" if record.get("resumed") else "seated",
            rank,
            record.get("waited_s", 0.0),
            record.get("wait_bound_s") or 0.0,
            record.get("reason"),
        )


def note_decision(metrics: Metrics | None, decision: str, waited_s: float, resumed: bool = False) -> None:
    if metrics is None:
        return
    metrics.admission_decisions.labels(decision).inc()
    if resumed:
        metrics.admission_resumed.inc()
    if waited_s > 0:
        metrics.admission_wait.observe(waited_s)


def note_parked(metrics: Metrics | None, rank: str) -> None:
    if metrics is not None:
        metrics.admission_parked.labels(rank).inc()
