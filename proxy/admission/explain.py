"""Each admission decision, said: the record kept on the session (``/admin/sessions/{id}``, the
dashboard) and the metrics counted for it.

A record names the decision (``room``, ``home``, ``over_budget``, ``after_wait``), how long the
session waited and why, the wait bound and idle TTL in force, and per rank the estimated costs:
its own prefill there, the prefill queued there, the tokens of other sessions it would push past the
budget and the share of them expected to be recomputed, the rank's measured speed, the total in
seconds, and how long its first token would wait if admitted there now (the longest it waits).
``placed`` adds the rank the router picked.
"""

from __future__ import annotations

from typing import Any

from proxy.admission.cost import Choice, Option
from proxy.ops.metrics import Metrics
from proxy.state.sessions import Session


def _round(value: float | None, digits: int = 4) -> float | None:
    return round(value, digits) if value is not None else None


def option_record(option: Option) -> dict[str, Any]:
    spt = option.seconds_per_token
    return {
        "rank": option.rank,
        "own_prefill_tokens": option.own_prefill_tokens,
        "queued_prefill_tokens": option.queued_prefill_tokens,
        "evicted_tokens": option.evicted_tokens,
        "expected_recompute_tokens": round(option.expected_recompute_tokens),
        "prefill_tokens_per_s": round(1.0 / spt) if spt else None,
        "cost_s": _round(option.cost_s),
        #: How long its first token would wait if admitted there now: the longest it waits for room.
        "start_s": _round(option.start_s),
        "room_in_s": _round(option.room_in_s),
    }


def decision_record(
    choice: Choice | None,
    decision: str,
    reason: str,
    *,
    at: float,
    waited_s: float,
    bound_s: float,
    idle_ttl_s: float,
    ended_after_s: float | None = None,
    home: str | None = None,
) -> dict[str, Any]:
    """What ``/admin/sessions/{id}`` shows of the latest decision for a session."""
    return {
        "at": at,
        "decision": decision,
        "reason": reason,
        "waited_s": round(waited_s, 4),
        "wait_bound_s": _round(bound_s),
        "idle_ttl_s": _round(idle_ttl_s),
        "ended_after_s": _round(ended_after_s),
        "allowed": sorted(choice.allowed) if choice is not None else ([home] if home else None),
        "rank": home,
        "room_in_s": _round(choice.room_in_s) if choice is not None else None,
        "room_chance": round(choice.room_chance, 3) if choice is not None else None,
        "options": [option_record(o) for o in choice.options] if choice is not None else [],
    }


def note_placed(session: Session, rank: str, choice: Choice | None, metrics: Metrics | None) -> None:
    """The router picked ``rank`` for a session admitted by ``choice``: record it, count it."""
    record = session.admission
    if record is not None and record.get("rank") is None:
        record["rank"] = rank
    if choice is None or metrics is None or choice.decision not in ("over_budget", "after_wait"):
        return
    metrics.admission_over_budget.labels(rank).inc()
    chosen = next((o for o in choice.options if o.rank == rank), None)
    if chosen is not None:
        metrics.admission_expected_recompute.labels(rank).inc(chosen.expected_recompute_tokens)


def note_decision(metrics: Metrics | None, decision: str, waited_s: float) -> None:
    if metrics is None:
        return
    metrics.admission_decisions.labels(decision).inc()
    if waited_s > 0:
        metrics.admission_wait.observe(waited_s)
