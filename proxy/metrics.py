"""Prometheus metrics of one prefixgate process (one registry per app, so tests can run several)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# The *_created series double the scrape size and tell nothing a restart counter does not.
disable_created_metrics()

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    def __init__(self) -> None:
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

    def render(self) -> bytes:
        return generate_latest(self.registry)
