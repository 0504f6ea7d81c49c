"""Stage 5, admit: per-rank session budgets against the KV pool (see ``gate.py``).

- ``gate.py``: ``Admission`` (admit, placed, finished, release, count, refresh), the whole rule in
  its docstring: the decisions (each said: the session's record, the metrics), the count they are
  made on, sessions moving between ranks, and what a turn weighs;
- ``accounting.py``: the pure count of each rank's active sessions and reservations;
- ``room.py``: which ranks have room for a session within their budgets, which session leaves a
  rank that outgrew its pool;
- ``rotation.py``: which quiet residents are parked for a session waiting past the rotation bound
  (the seat granted, ``Admitted`` and ``Before`` are request records: ``proxy/context.py``);
- ``queue.py``: the wait for a seat, by priority and weighted-fair across client keys;
- ``learned.py``: what the traffic and the ranks teach (how far sessions grow, how long agents
  think, when a session has ended, the rotation bound, how fast each rank computes);
- ``refusals.py``: the 429s and the 400;
- ``config.py``: the settings.
"""

from __future__ import annotations

from proxy.admission.accounting import RankState, Reservation
from proxy.admission.config import AdmissionConfig
from proxy.admission.gate import Admission, Placement
from proxy.admission.learned import RankSpeeds
from proxy.config import Settings
from proxy.ops.metrics import Metrics
from proxy.state.claims import RoomClaims
from proxy.state.sessions import SessionTable
from routing.ranks import Fleet


def admission_from_settings(
    settings: Settings,
    table: SessionTable,
    fleet: Fleet,
    metrics: Metrics,
    block_size: int,
    placement: Placement | None = None,
    claims: RoomClaims | None = None,
    speeds: RankSpeeds | None = None,
) -> Admission:
    """``Admission`` for ``no_admission``, ``admission_queue``, ``target_fraction``,
    ``session_idle_ttl`` and ``admission_wait`` (None: learned), ... ."""
    config = AdmissionConfig(
        enabled=not settings.no_admission,
        target_fraction=settings.target_fraction,
        idle_ttl=settings.session_idle_ttl,
        wait=settings.admission_wait,
        max_sessions_per_rank=settings.max_sessions_per_rank or None,
        block_size=block_size,
        max_queue=settings.admission_queue or None,
    )
    return Admission(table, fleet, config, metrics, placement, claims, speeds)


__all__ = [
    "Admission",
    "AdmissionConfig",
    "Placement",
    "RankSpeeds",
    "RankState",
    "Reservation",
    "admission_from_settings",
]
