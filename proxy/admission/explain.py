"""Each admission decision, said: the record kept on the session (``/admin/sessions/{id}``, the
dashboard) and the metrics counted for it.

A record names the decision (``room``, ``released``, ``rotated``; ``parked`` when the session gave
up its seat for a waiter), why, how long the session waited, whether it resumed after a park or an
end, the rotation bound and idle TTL in force, and the ranks it was allowed. ``placed`` adds the
rank the router picked.
"""

from __future__ import annotations

from typing import Any

from proxy.admission.seat import Seat
from proxy.ops.metrics import Metrics
from proxy.state.sessions import Session
from proxy.tenants import shown_to


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
    """The router picked ``rank`` for a session just seated: record it."""
    record = session.admission
    if record is not None and record.get("rank") is None:
        record["rank"] = rank


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
