"""Stage 5, admit: per-rank session budgets against the KV pool (see ``gate.py``).

- ``gate.py``: ``Admission``, the stage's face (admit, placed, finished, release, count, refresh);
- ``accounting.py``: the pure count of each rank's active sessions and reservations;
- ``room.py``: the policy: which ranks have room for a new session, which session leaves a rank
  that outgrew its pool;
- ``queue.py``: the FIFO wait for room;
- ``growth.py``, ``think_gaps.py``: what the traffic teaches (how far sessions grow, how long
  agents think);
- ``config.py``: the settings and the rule that judges a quiet session ended.
"""

from __future__ import annotations

from proxy.admission.accounting import RankState, Reservation
from proxy.admission.config import AdmissionConfig
from proxy.admission.gate import Admission, Admitted
from proxy.config import Settings
from proxy.ops.metrics import Metrics
from proxy.state.sessions import SessionTable
from routing.ranks import Fleet


def admission_from_settings(
    settings: Settings, table: SessionTable, fleet: Fleet, metrics: Metrics, block_size: int
) -> Admission:
    """``Admission`` for ``no_admission``, ``target_fraction``, ``session_idle_ttl``, ... ."""
    config = AdmissionConfig(
        enabled=not settings.no_admission,
        target_fraction=settings.target_fraction,
        idle_ttl=settings.session_idle_ttl,
        wait=settings.admission_wait,
        max_sessions_per_rank=settings.max_sessions_per_rank or None,
        block_size=block_size,
    )
    return Admission(table, fleet, config, metrics)


__all__ = [
    "Admission",
    "AdmissionConfig",
    "Admitted",
    "RankState",
    "Reservation",
    "admission_from_settings",
]
