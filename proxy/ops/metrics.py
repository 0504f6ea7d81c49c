"""Prometheus metrics of one prefixgate process (one registry per app, so tests can run several).

The stages count into it as requests go; it reads nothing of them (the gauges read from the state at
scrape time are set by ``proxy/ops/gauges.py``, called where the app serves ``/metrics``)."""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from proxy.ops.traffic import Traffic

# The *_created series double the scrape size and tell nothing a restart counter does not.
disable_created_metrics()

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
        #: The recent answers behind the dashboard's request rate, latency, errors and 429s.
        self.traffic = Traffic()
        self._series: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "prefixgate_requests",
            "Requests answered, by endpoint, backend and HTTP status",
            ("endpoint", "backend", "status"),
            registry=r,
        )
        self.duration = Histogram(
            "prefixgate_request_duration_seconds",
            "Time from request arrival to the last byte sent, by endpoint",
            ("endpoint",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttfb = Histogram(
            "prefixgate_time_to_first_byte_seconds",
            "Time from request arrival to the first response byte relayed, by endpoint",
            ("endpoint",),
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream_failures = Counter(
            "prefixgate_upstream_failures",
            "Failed attempts at a backend, by backend and reason",
            ("backend", "reason"),
            registry=r,
        )
        self.retries = Counter(
            "prefixgate_retries", "Requests retried on another backend", ("endpoint",), registry=r
        )
        self.upstream_reconnects = Counter(
            "prefixgate_upstream_reconnects",
            "Requests sent again on a fresh connection to the same backend, their pooled connection "
            "having been closed by the backend before any response byte (not a backend failure)",
            ("backend",),
            registry=r,
        )
        self.stream_errors = Counter(
            "prefixgate_stream_errors",
            "Streams that broke after bytes were sent (ended with an SSE error event)",
            ("backend",),
            registry=r,
        )
        self.client_disconnects = Counter(
            "prefixgate_client_disconnects",
            "Requests whose client went away first",
            ("endpoint",),
            registry=r,
        )
        self.in_flight = Gauge(
            "prefixgate_in_flight", "Requests in flight, by backend", ("backend",), registry=r
        )
        self.backend_up = Gauge(
            "prefixgate_backend_up", "1 when the backend is healthy", ("backend",), registry=r
        )
        self.prompt_tokens = Counter(
            "prefixgate_prompt_tokens", "Prompt tokens reported by the backends", ("backend",), registry=r
        )
        self.cached_tokens = Counter(
            "prefixgate_cached_tokens",
            "Prompt tokens the backends reported as prefix-cache hits (usage...cached_tokens)",
            ("backend",),
            registry=r,
        )
        self.completion_tokens = Counter(
            "prefixgate_completion_tokens",
            "Completion tokens reported by the backends",
            ("backend",),
            registry=r,
        )

        # routing and the prefix index
        self.predicted_cached_tokens = Counter(
            "prefixgate_predicted_cached_tokens",
            "Prompt tokens the prefix index predicted as cache hits, for requests whose rank reported",
            ("backend",),
            registry=r,
        )
        self.reported_cached_tokens = Counter(
            "prefixgate_reported_cached_tokens",
            "Cache-hit tokens the ranks reported for the requests counted in predicted_cached_tokens",
            ("backend",),
            registry=r,
        )
        self.index_corrections = Counter(
            "prefixgate_index_corrections",
            "Requests whose rank hit fewer tokens than predicted (its mirror was trimmed)",
            ("backend",),
            registry=r,
        )
        self.session_moves = Counter(
            "prefixgate_session_moves",
            "Known sessions routed off their rank, by what that rank held of the prompt's leading "
            "blocks: cpu (some of them only in its CPU tier), gpu (all in its GPU pool), none (each "
            "move recomputes what the rank held)",
            ("held",),
            registry=r,
        )
        self.index_redis_up = Gauge(
            "prefixgate_index_redis_up",
            "1 while the Redis prefix index is reachable; 0 while routing uses the local mirror",
            registry=r,
        )
        self.admission_shared_up = Gauge(
            "prefixgate_admission_shared_up",
            "1 while admission takes room from the claims shared in Redis; 0 while this replica "
            "admits on its own count",
            registry=r,
        )
        self.redis_writes_queued = Gauge(
            "prefixgate_redis_writes_queued",
            "Writes to Redis queued for the link's thread (session records, index records, claims)",
            registry=r,
        )
        self.redis_write_wait = Gauge(
            "prefixgate_redis_write_wait_seconds",
            "How long the latest write to Redis waited in the link's queue: how late the other "
            "replicas saw it",
            registry=r,
        )
        self.session_saves_dropped = Gauge(
            "prefixgate_session_saves_dropped",
            "Session saves of this process Redis dropped since it started, for a later version another "
            "replica saved meanwhile (that turn's usage counters lost)",
            registry=r,
        )
        self.kv_event_writer = Gauge(
            "prefixgate_kv_event_writer",
            "1 while this replica holds the rank's KV-event lease and writes its mirror to the shared "
            "index (across replicas, each event-fed rank should have exactly one)",
            ["backend"],
            registry=r,
        )
        self.kv_events = Counter(
            "prefixgate_kv_events",
            "KV-cache events applied to a rank's mirror, by backend and event type",
            ("backend", "type"),
            registry=r,
        )
        self.kv_event_faults = Counter(
            "prefixgate_kv_event_faults",
            "Faults in a rank's KV-event feed: gap (batches missed), replay_drop (a replay cut short), "
            "restart (publisher started over), error (batch not applied), unmapped (blocks not keyed)",
            ("backend", "fault"),
            registry=r,
        )

        # client keys (proxy/auth.py): labelled by the key's label, never by the key
        self.client_requests = Counter(
            "prefixgate_client_requests",
            "Authenticated requests, by the label of the client's API key",
            ("client",),
            registry=r,
        )
        self.auth_rejections = Counter(
            "prefixgate_auth_rejections",
            "Requests answered 401, by reason (missing, invalid, admin)",
            ("reason",),
            registry=r,
        )

        self.canonical_rewrites = Counter(
            "prefixgate_canonical_rewrites",
            "Rewrites made by canonicalization rules, by rule",
            ("rule",),
            registry=r,
        )

        # the prefix-break explainer (proxy/explain.py)
        self.prefix_breaks = Counter(
            "prefixgate_prefix_breaks",
            "Turns whose prompt stopped extending the session's previous turn (or whose rank lost it), "
            "by cause",
            ("cause",),
            registry=r,
        )

        # sessions and admission control (proxy/sessions.py, proxy/admission.py)
        self.sessions_active = Gauge(
            "prefixgate_sessions_active",
            "Sessions seen within the idle TTL, by the backend holding them",
            ("backend",),
            registry=r,
        )
        self.admission_queue_depth = Gauge(
            "prefixgate_admission_queue_depth",
            "Sessions waiting for a seat on a rank (this replica's queue)",
            registry=r,
        )
        self.admission_queued = Counter(
            "prefixgate_admission_queued",
            "Sessions that had to wait for a seat in the admission queue",
            registry=r,
        )
        self.admission_rejected = Counter(
            "prefixgate_admission_rejected",
            "Sessions answered 429 or 400 by admission, by reason (client_sessions, queue_full, "
            "context_length)",
            ("reason",),
            registry=r,
        )
        self.admission_decisions = Counter(
            "prefixgate_admission_decisions",
            "Seats given to new or returning sessions, by decision (room: within a budget; released: "
            "once sessions judged ended gave up theirs; rotated: once quiet residents were parked)",
            ("decision",),
            registry=r,
        )
        self.admission_wait = Histogram(
            "prefixgate_admission_wait_seconds",
            "Time sessions waited for a seat (those that waited)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.admission_waits_past_bound = Counter(
            "prefixgate_admission_waits_past_bound",
            "Sessions seated after waiting longer than the rotation bound in force and one poll "
            "interval (a rotation's own latency), by why no seat rotated sooner: busy (no resident "
            "quiet), unserved (none quiet had been answered since it was seated), short (those "
            "parkable free too little on any one rank), behind (another waiter was first)",
            ("reason",),
            registry=r,
        )
        self.admission_parked = Counter(
            "prefixgate_admission_parked",
            "Quiet sessions that gave up their seat, by the backend they were parked on and why: "
            "waiter (for a session waiting past the rotation bound) or pool (the backend's sessions "
            "outgrew what it holds)",
            ("backend", "reason"),
            registry=r,
        )
        self.admission_resumed = Counter(
            "prefixgate_admission_resumed",
            "Sessions seated again after they were parked or judged ended",
            registry=r,
        )
        self.admission_idle_ttl = Gauge(
            "prefixgate_admission_idle_ttl_seconds",
            "Seconds after its last request a session counts as ended (configured or learned from "
            "the think gaps)",
            registry=r,
        )
        self.admission_wait_bound = Gauge(
            "prefixgate_admission_wait_bound_seconds",
            "Wait for a seat after which quiet residents are parked for it (configured or learned from "
            "request durations)",
            registry=r,
        )
        self.rank_prefill_rate = Gauge(
            "prefixgate_rank_prefill_tokens_per_second",
            "A backend's prefill speed as its own metrics measure it (prefill time per computed token)",
            ("backend",),
            registry=r,
        )
        self.rank_working_set = Gauge(
            "prefixgate_rank_working_set_tokens",
            "Context tokens of the active sessions on a backend (its KV working set)",
            ("backend",),
            registry=r,
        )
        self.rank_pool_tokens = Gauge(
            "prefixgate_rank_pool_tokens", "KV cache pool of a backend, in tokens", ("backend",), registry=r
        )
        self.rank_over_pool = Gauge(
            "prefixgate_rank_over_pool",
            "1 while a backend's active working set exceeds its pool (it gets no new sessions)",
            ("backend",),
            registry=r,
        )
        self.fleet_hit_rate = Gauge(
            "prefixgate_fleet_hit_rate",
            "Prefix-cache hit tokens over prompt tokens across the last 1,000 answered requests",
            registry=r,
        )
        self.session_hit_rate = Gauge(
            "prefixgate_session_hit_rate",
            "Reported prefix-cache hit rate of each active session",
            ("session", "backend"),
            registry=r,
        )

        self.session_memory = Gauge(
            "prefixgate_session_memory_bytes",
            "What this process keeps per session between turns (previous turns' tokens and block "
            "hashes, the explainer's previous body, the turn log), all sessions together",
            registry=r,
        )
        self.session_memory_budget = Gauge(
            "prefixgate_session_memory_budget_bytes", "--session-memory-mb, in bytes", registry=r
        )
        self.session_evictions = Counter(
            "prefixgate_session_memory_evictions",
            "Sessions whose kept turns were dropped to make room (their next turn is tokenized whole)",
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def series(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, resolved once: ``labels`` validates, joins and locks on every
        call (~2 us), several times a request. The per-request series only (endpoint, rank, status,
        client key label) and the per-batch KV-event counts (rank, event type): their label values
        are few and never removed."""
        key = (id(metric), values)
        found = self._series.get(key)
        if found is None:
            found = self._series[key] = metric.labels(*values)
        return found
