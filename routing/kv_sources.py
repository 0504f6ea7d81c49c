"""Where a rank publishes its KV-cache events: the ``kv_events`` setting's ``NAME=tcp://H:P[|tcp://H:P]``
entries (the configuration validates them at load; ``proxy.state.kv_feeds`` subscribes)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EventSource:
    rank: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def parse_kv_event_specs(spec: str) -> list[EventSource]:
    """``NAME=tcp://h:p[|tcp://h:p],...`` to sources (``auto`` is resolved by asking the ranks)."""
    sources = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, endpoints = item.partition("=")
        endpoint, _, replay = endpoints.partition("|")
        if not sep or not name.strip() or "://" not in endpoint:
            raise ValueError(
                f"kv_events entry {item!r} is not NAME=tcp://HOST:PORT[|tcp://HOST:PORT]; "
                "or set kv_events to 'auto'"
            )
        sources.append(EventSource(name.strip(), endpoint.strip(), replay.strip() or None))
    return sources
