"""The JSON the dashboard page and ``prefixgate top`` poll, built from the running gateway's state.

Every function here reads; none changes the gateway. Shapes (all times wall-clock seconds):

- ``overview()``: ``fleet`` (hit rate over the last 1,000 requests and since start, prompt tokens
  computed per 100 sent), ``series`` (points after ``since``, fields named in ``series_fields``) and
  ``live`` (the point for now), ``ranks`` (pool, budget, working set of the active sessions, in
  flight, health, hit rate; from its own metrics its prefill speed, requests waiting and running
  and KV cache use; from prefixgate's index the tokens it holds by tier, ``index_tokens``: ``gpu``
  with a GPU copy, ``cpu`` in CPU memory only, by vLLM's KV offloading), ``admission`` (policy,
  the clocks in force, queue depth, queued, rejections by reason, decisions by kind, over-budget
  admissions by rank with their expected recompute and the misses that followed), ``breaks``
  (prefix breaks by cause), ``rewrites`` (canonicalization rewrites by rule), ``traffic`` (request
  rate, time to first byte p50/p99, errors and 429s: ``proxy.ops.traffic``) and ``settings`` (the
  active policy and what else decides placement).
- ``session_rows()``: the sessions table (key, rank, turns, context tokens, hit rate, last break,
  idle seconds).
- ``session_detail()``: one session with its turns (hits per turn), its breaks, its threads (main
  conversation, side requests, sub-agents: ``proxy.state.local.ThreadLocal.to_dict``) and
  admission's last decision for it (why it waited, where it went, the costs weighed per rank).
"""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter

from proxy.ops.dashboard.stats import HIT_RATE_WINDOW, Point, Recorder, computed_per_100, hit_rate
from proxy.ops.running import Running
from proxy.state.sessions import Session
from proxy.tenants import client_view

SERIES_FIELDS = ("time", "window_rate", "cumulative_rate", "interval_rate", "computed_per_100", "requests")


def counter_values(counter: Counter, label: str) -> dict[str, float]:
    """A labelled counter's value per value of ``label``, summed over its other labels (through
    ``collect``, the client's public API)."""
    out: dict[str, float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                value = sample.labels[label]
                out[value] = out.get(value, 0.0) + sample.value
    return out


def counter_total(counter: Counter) -> float:
    return sum(s.value for f in counter.collect() for s in f.samples if s.name.endswith("_total"))


def _point(point: Point) -> list[Any]:
    return list(point)


def overview(
    gateway: Running, recorder: Recorder, since: float | None = None, *, show_urls: bool = True
) -> dict[str, Any]:
    """Fleet, series, ranks and admission as one document (see the module docstring); each rank's
    ``url`` only with ``show_urls`` (the admin)."""
    admission = gateway.admission
    metrics = gateway.metrics
    window = recorder.window
    total = recorder.total
    now = recorder.clock()
    states = admission.count(now) if admission is not None else {}
    ranks: list[dict[str, Any]] = []
    router = gateway.router
    for rank in gateway.fleet:
        state = states.get(rank.name)
        gpu_blocks, cpu_blocks = router.index.held_by_tier(rank.name) if router is not None else (0, 0)
        block = router.block_size if router is not None else 0
        hits = recorder.per_rank.get(rank.name)
        load = admission.speeds.load(rank.name) if admission is not None else None
        pool = rank.pool_tokens
        working = state.working_set_tokens if state is not None else 0
        ranks.append(
            {
                "name": rank.name,
                "url": rank.url if show_urls else None,
                "healthy": rank.healthy,
                "last_error": rank.last_error,
                "in_flight": rank.in_flight,
                "pool_tokens": pool,
                "budget_tokens": state.budget_tokens if state is not None else None,
                "working_set_tokens": working,
                "occupancy": working / pool if pool else None,
                "sessions": state.sessions if state is not None else 0,
                "reserved_tokens": state.reserved_tokens if state is not None else 0,
                "over_pool": state.over_pool if state is not None else False,
                "hit_rate": hits.rate if hits is not None else None,
                "requests": hits.requests if hits is not None else 0,
                # what the rank's own /metrics said at the last poll
                "prefill_tokens_per_s": admission.speeds.tokens_per_second(rank.name) if admission else None,
                "waiting_requests": load.waiting if load is not None else None,
                "running_requests": load.running if load is not None else None,
                "kv_cache_usage": load.kv_usage if load is not None else None,
                "index_tokens": {"gpu": gpu_blocks * block, "cpu": cpu_blocks * block},
            }
        )
    config = admission.config if admission is not None else None
    clocks = admission.clocks() if admission is not None else None
    active = sum(s["sessions"] for s in ranks)
    return {
        "object": "overview",
        "time": now,
        "fleet": {
            "window": {
                "requests": len(window),
                "size": HIT_RATE_WINDOW,
                "hit_rate": hit_rate(window.queried, window.hits),
                "computed_per_100": computed_per_100(window.queried, window.hits),
            },
            "cumulative": {
                **total.to_dict(),
                "hit_rate": total.rate,
                "computed_per_100": computed_per_100(total.queried, total.hits),
            },
            "active_sessions": active,
            "healthy_ranks": sum(1 for r in gateway.fleet if r.healthy),
            "ranks": len(gateway.fleet),
        },
        "series_fields": SERIES_FIELDS,
        "series": [_point(p) for p in recorder.points(since)],
        "live": _point(recorder.live()),
        "sample_interval": recorder.series.interval,
        "ranks": ranks,
        "admission": {
            "enabled": bool(config and config.enabled),
            "target_fraction": config.target_fraction if config else None,
            "idle_ttl": clocks["idle_ttl_s"] if clocks else None,
            "clocks": clocks,
            "queue_depth": len(admission.queue) if admission is not None else 0,
            "queued": counter_total(metrics.admission_queued),
            "rejected": counter_values(metrics.admission_rejected, "reason"),
            "decisions": counter_values(metrics.admission_decisions, "decision"),
            "parked": counter_values(metrics.admission_parked, "backend"),
            "resumed": counter_total(metrics.admission_resumed),
        },
        "breaks": counter_values(metrics.prefix_breaks, "cause"),
        "rewrites": counter_values(metrics.canonical_rewrites, "rule"),
        "traffic": metrics.traffic.summary(),
        "settings": settings_view(gateway),
    }


def settings_view(gateway: Running) -> dict[str, Any]:
    """What decides placement in this process, as the operator set it (no secrets, no URLs)."""
    settings = gateway.settings
    router = gateway.router
    return {
        "policy": settings.policy,
        "balance_factor": settings.balance_factor,
        "canonicalize": not settings.no_canonicalize,
        "admission": not settings.no_admission,
        "target_fraction": settings.target_fraction,
        "session_idle_ttl": settings.session_idle_ttl,
        "admission_wait": settings.admission_wait,
        "max_sessions_per_rank": settings.max_sessions_per_rank or None,
        "state": gateway.state.name,
        "kv_events": "auto" if (settings.kv_events or "").strip() == "auto" else bool(settings.kv_events),
        "exact_ranks": sorted(router.exact) if router is not None else [],
        "block_size": router.block_size if router is not None else None,
        "tokenizer": settings.tokenization.get("kind", "tiktoken"),
        "retries": settings.retries,
    }


def _last_break(gateway: Running, session: Session) -> dict[str, Any] | None:
    # Redis pages load records without their breaks: this replica's explainer has the recent ones
    breaks = session.breaks or gateway.explainer.breaks(session.key)
    if not breaks:
        return None
    last = breaks[-1]
    return {k: last.get(k) for k in ("turn", "time", "cause", "detail", "part")}


def session_row(gateway: Running, session: Session, now: float, idle_ttl: float) -> dict[str, Any]:
    """One line of the sessions table."""
    return {
        "key": client_view(session.key, session.client),
        "rank": session.rank,
        "client": session.client,
        "turns": session.turns,
        "context_tokens": session.context_tokens,
        "prompt_tokens_sent": session.prompt_tokens_sent,
        "hit_tokens_reported": session.hit_tokens_reported,
        "hit_rate": session.hit_rate,
        "last_break": _last_break(gateway, session),
        "idle_s": max(0.0, now - session.last_seen),
        "active": session.is_active(now, idle_ttl),
    }


def session_rows(
    gateway: Running,
    *,
    viewer: str | None,
    sort: str = "last_seen",
    descending: bool = True,
    limit: int = 50,
    active_only: bool = False,
) -> dict[str, Any]:
    """The sessions table, most recently seen first (``viewer``: only that client's sessions)."""
    table = gateway.sessions
    page = table.page(sort=sort, descending=descending, limit=limit, active_only=active_only, client=viewer)
    now = table.clock()
    ttl = table.idle_ttl
    return {
        "object": "list",
        "total": page.total,
        "data": [session_row(gateway, s, now, ttl) for s in page.sessions],
    }


def session_detail(gateway: Running, recorder: Recorder, session: Session) -> dict[str, Any]:
    """A session's row with its turns (hit tokens per turn) and its prefix breaks."""
    table = gateway.sessions
    now = table.clock()
    row = session_row(gateway, session, now, table.idle_ttl)
    breaks = session.breaks or gateway.explainer.breaks(session.key)
    row["created"] = session.created
    row["hit_tokens_estimated"] = session.hit_tokens_estimated
    row["prefill_tokens"] = session.prefill_tokens
    row["turns_log"] = recorder.turns.as_json(session.key)
    row["breaks"] = breaks
    # why it waited, where it went and what admission weighed (``proxy/admission/explain.py``)
    row["admission"] = session.admission
    row["threads"] = gateway.threads_of(session.key)
    return row
