"""The gauges read at scrape time (``GET /metrics``): set from the process's current state.

Reading the state changes nothing. ``proxy/app.py`` calls ``export_gauges`` before it renders the
registry (``proxy/ops/metrics.py``, which the stages count into and which names none of them).
"""

from __future__ import annotations

from proxy.admission import Admission
from proxy.ops.metrics import Metrics
from proxy.state.sessions import SessionTable
from routing.ranks import Fleet


def export_gauges(
    metrics: Metrics,
    fleet: Fleet,
    admission: Admission | None,
    fleet_hit_rate: float,
    sessions: SessionTable,
    max_sessions: int = 1000,
    *,
    per_session: bool = True,
    session_memory: tuple[int, int] | None = None,
    backlog: tuple[int, float] | None = None,
    dropped_saves: int | None = None,
    event_writer_of: frozenset[str] | None = None,
) -> None:
    """Set the gauges read at scrape time from the current state (reading it changes nothing):
    per rank its health, load and admission count, the fleet hit rate, the active sessions' hit rates
    (only with ``per_session``: the admin's scrape; session keys are the clients' business) and
    ``session_memory``: what the sessions' kept turns hold, and their budget (bytes); ``backlog``:
    the writes queued for Redis and the latest one's wait (``StateBackend.backlog``);
    ``dropped_saves``: ``StateBackend.dropped_saves``; ``event_writer_of``:
    ``PrefixIndex.event_writer_of`` (None: no shared index)."""
    for rank in fleet:
        metrics.backend_up.labels(rank.name).set(1 if rank.healthy else 0)
        metrics.in_flight.labels(rank.name).set(rank.in_flight)
    if admission is not None:
        clocks = admission.clocks()
        metrics.admission_idle_ttl.set(float(clocks["idle_ttl_s"] or 0.0))
        metrics.admission_wait_bound.set(float(clocks["wait_bound_s"] or 0.0))
        for rank in fleet:
            speed = admission.speeds.tokens_per_second(rank.name)
            if speed is not None:
                metrics.rank_prefill_rate.labels(rank.name).set(speed)
        for state in admission.count().values():
            metrics.sessions_active.labels(state.name).set(state.sessions)
            metrics.rank_working_set.labels(state.name).set(state.working_set_tokens)
            metrics.rank_over_pool.labels(state.name).set(1 if state.over_pool else 0)
            if state.pool_tokens is not None:
                metrics.rank_pool_tokens.labels(state.name).set(state.pool_tokens)
    metrics.fleet_hit_rate.set(fleet_hit_rate)
    if backlog is not None:
        metrics.redis_writes_queued.set(backlog[0])
        metrics.redis_write_wait.set(backlog[1])
    if dropped_saves is not None:
        metrics.session_saves_dropped.set(dropped_saves)
    if event_writer_of is not None:
        for rank in fleet:
            metrics.kv_event_writer.labels(rank.name).set(1 if rank.name in event_writer_of else 0)
    if session_memory is not None:
        metrics.session_memory.set(session_memory[0])
        metrics.session_memory_budget.set(session_memory[1])
    gauge = metrics.session_hit_rate
    # only active sessions are exported, so the series come and go with the sessions
    gauge.clear()
    if not per_session:
        return
    active = sorted(sessions.active(), key=lambda s: s.last_seen, reverse=True)[:max_sessions]
    for session in active:
        rate = session.hit_rate
        if rate is not None:
            gauge.labels(session.key, session.rank or "").set(rate)
