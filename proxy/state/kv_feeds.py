"""The KV-event feeds that keep the prefix index exact: one vLLM KV-event subscription per rank.

``kv_events`` settings: ``auto`` (ask every rank's ``GET /kv_event_sources``), or comma-separated
``NAME=tcp://HOST:PORT`` entries, each optionally followed by ``|tcp://HOST:PORT`` for the replay
socket. A rank fed by events is mirrored exactly (no speculative records or corrections).
"""

from __future__ import annotations

import logging
import time
from urllib.parse import urlsplit

import aiohttp
import orjson

from proxy.ops.metrics import Metrics
from proxy.stages.route import Router
from routing.kv_events import KVEventSubscriber, RankMirror
from routing.kv_sources import EventSource, parse_kv_event_specs
from routing.ranks import Rank
from tokenization.hashers import ChainHasher

log = logging.getLogger("prefixgate.routing")

#: How long start-up waits for the ranks' KV-event feeds to catch up (their replays), all together.
CATCH_UP_S = 5.0


async def discover_source(client: aiohttp.ClientSession, rank: Rank) -> EventSource | None:
    """The rank's own answer at ``GET /kv_event_sources``, reachable from here (vLLM reports the
    endpoint it bound, ``tcp://*:5557``)."""
    try:
        async with client.get(f"{rank.url}/kv_event_sources", timeout=aiohttp.ClientTimeout(total=3)) as r:
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
    host = urlsplit(rank.url).hostname or "127.0.0.1"
    return EventSource(
        rank.name,
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


async def start_kv_event_feeds(
    spec: str | None,
    client: aiohttp.ClientSession,
    router: Router,
    hasher: ChainHasher | None,
    metrics: Metrics,
) -> list[KVEventSubscriber]:
    """Subscribe to the ranks' KV events named by ``spec`` (the ``kv_events`` setting); each
    subscribed rank's mirror becomes exact."""
    if not spec:
        return []
    if hasher is None:
        log.warning("kv_events needs the blocks stage (a prefix-aware policy): not subscribing")
        return []
    if spec.strip() == "auto":
        found = [await discover_source(client, b) for b in router.fleet]
        sources = [s for s in found if s is not None]
        silent = [rank.name for rank, source in zip(router.fleet, found, strict=True) if source is None]
        if silent:
            # without events a rank's mirror is prefixgate's own guess: say so, once, at start
            log.warning(
                "kv_events auto: no KV-event source from %s (GET /kv_event_sources answered none; vLLM "
                "reports one when started with --kv-events-config and endpoint tcp://*:0): %s",
                ", ".join(silent),
                "no rank is mirrored exactly" if not sources else "those ranks are not mirrored exactly",
            )
    else:
        sources = parse_kv_event_specs(spec)
    subscribers = []
    for source in sources:
        if router.fleet.get(source.rank) is None:
            log.warning("kv_events names unknown rank %s: ignored", source.rank)
            continue

        def count(kind: str, rank: str = source.rank) -> None:
            metrics.kv_events.labels(rank, kind).inc()

        def fault(kind: str, count: int, rank: str = source.rank) -> None:
            metrics.kv_event_faults.labels(rank, kind).inc(count)

        # stored blocks are mirrored from then on, no longer in flight
        confirm = router.inflight_blocks.confirm
        mirror = RankMirror(source.rank, router.index, hasher, on_event=count, on_stored=confirm)
        subscriber = KVEventSubscriber(
            mirror, source.endpoint, source.replay_endpoint, source.topic, on_fault=fault
        )
        router.set_exact(source.rank)
        subscribers.append(subscriber.start(wait_s=0))
        log.info("rank %s: KV events from %s", source.rank, source.endpoint)
    # Every rank catches up at once: a fleet's start waits for its slowest replay, not their sum.
    deadline = time.monotonic() + CATCH_UP_S
    for subscriber in subscribers:
        if not subscriber.connected.wait(max(0.0, deadline - time.monotonic())):
            rank = subscriber.mirror.rank
            log.warning("rank %s: KV events still catching up after %.0f s", rank, CATCH_UP_S)
    return subscribers
