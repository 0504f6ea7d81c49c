"""Where a rank publishes its KV-cache events: the ``kv_events`` setting's ``NAME=tcp://H:P[|tcp://H:P]``
entries (the configuration validates them at load), or under ``auto`` the rank's own answer at
``GET /kv_event_sources`` (``discover_source``; ``routing.rank_facts`` asks it whenever it learns the
rank). ``proxy.state.kv_feeds`` subscribes."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp
import orjson


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


async def discover_source(
    client: aiohttp.ClientSession, name: str, url: str, timeout: float = 3.0
) -> EventSource | None:
    """The rank's own answer at ``GET /kv_event_sources``, reachable from here (vLLM reports the
    endpoint it bound, ``tcp://*:5557``); None when it reports none or does not answer."""
    try:
        async with client.get(f"{url}/kv_event_sources", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            if r.status != 200:
                return None
            sources = orjson.loads(await r.read())
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
        return None
    if not isinstance(sources, list) or not sources or not isinstance(sources[0], dict):
        return None
    first = sources[0]
    endpoint = first.get("endpoint")
    if not isinstance(endpoint, str):
        return None
    replay = first.get("replay_endpoint")
    host = urlsplit(url).hostname or "127.0.0.1"
    return EventSource(
        name,
        reachable(endpoint, host),
        reachable(replay, host) if isinstance(replay, str) else None,
        first.get("topic") or "",
    )


#: Hosts a rank binds to that say "every interface", not where to connect.
_WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", ""})


def reachable(endpoint: str, host: str) -> str:
    """``endpoint`` as another machine connects to it: a rank that bound ``tcp://*:5557`` (vLLM's
    default) or ``tcp://0.0.0.0:5557`` is reached at its own URL's ``host``."""
    scheme, sep, rest = endpoint.partition("://")
    bound, colon, port = rest.rpartition(":")
    if not sep or not colon or bound not in _WILDCARD_HOSTS:
        return endpoint
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    return f"{scheme}://{host}:{port}"
