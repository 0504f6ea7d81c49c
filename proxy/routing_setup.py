"""Assembling stage 6 from the settings: the prefix index, the policy, the router, KV-event feeds.

``kv_events`` settings: ``auto`` (ask every rank's ``GET /kv_event_sources``), or comma-separated
``NAME=tcp://HOST:PORT`` entries, each optionally followed by ``|tcp://HOST:PORT`` for the replay
socket. A rank fed by events is mirrored exactly (no speculative records or corrections).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import aiohttp
import orjson

from proxy.config import Settings
from proxy.metrics import Metrics
from proxy.route import Router
from routing.index import PrefixIndex
from routing.index.memory import MemoryPrefixIndex
from routing.kv_events import KVEventSubscriber, RankMirror
from routing.policies import make_policy
from routing.ranks import Fleet, Rank
from tokenization.hashers import ChainHasher

log = logging.getLogger("prefixgate.routing")


@dataclass(frozen=True, slots=True)
class EventSource:
    backend: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""


def parse_kv_event_specs(spec: str) -> list[EventSource]:
    """``NAME=tcp://h:p[|tcp://h:p],...`` to sources (``auto`` is resolved by ``discover_sources``)."""
    sources = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, endpoints = item.partition("=")
        if not sep:
            raise ValueError(f"kv_events entry {item!r} is not NAME=tcp://HOST:PORT[|tcp://HOST:PORT]")
        endpoint, _, replay = endpoints.partition("|")
        sources.append(EventSource(name.strip(), endpoint.strip(), replay.strip() or None))
    return sources


async def discover_source(client: aiohttp.ClientSession, backend: Rank) -> EventSource | None:
    """The rank's own answer at ``GET /kv_event_sources`` (vLLM reports it with ``tcp://*:0``)."""
    try:
        async with client.get(f"{backend.url}/kv_event_sources", timeout=aiohttp.ClientTimeout(total=3)) as r:
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
    return EventSource(backend.name, endpoint, first.get("replay_endpoint"), first.get("topic") or "")


def build_index(
    settings: Settings, metrics: Metrics, model: str, block_size: int, hash_algo: str = "sha256"
) -> PrefixIndex:
    if not settings.redis_url:
        return MemoryPrefixIndex()
    from routing.index.redis_store import RedisPrefixIndex

    def on_state(up: bool) -> None:
        metrics.index_redis_up.set(1 if up else 0)
        if up:
            log.info("redis is reachable again: prefix index resynchronized")
        else:
            log.warning("redis unreachable: routing from the local mirror until it returns")

    index = RedisPrefixIndex(
        settings.redis_url,
        model=model,
        block_size=block_size,
        hash_algo=hash_algo,
        ttl_s=settings.index_ttl,
        socket_timeout=settings.redis_timeout,
        on_state=on_state,
    )
    metrics.index_redis_up.set(1)
    return index


def build_router(
    settings: Settings,
    pool: Fleet,
    metrics: Metrics,
    model: str,
    block_size: int,
    hash_algo: str = "sha256",
) -> Router:
    policy = make_policy(settings.policy, balance_factor=settings.balance_factor)
    index = build_index(settings, metrics, model, block_size, hash_algo)
    return Router(pool, policy, index, block_size=block_size, metrics=metrics)


async def start_kv_event_feeds(
    settings: Settings,
    client: aiohttp.ClientSession,
    router: Router,
    hasher: ChainHasher | None,
    metrics: Metrics,
) -> list[KVEventSubscriber]:
    """Subscribe to the configured ranks' KV events; each subscribed rank's mirror becomes exact."""
    spec = settings.kv_events
    if not spec:
        return []
    if hasher is None:
        log.warning("kv_events needs the blocks stage (a prefix-aware policy): not subscribing")
        return []
    if spec.strip() == "auto":
        found = [await discover_source(client, b) for b in router.pool]
        sources = [s for s in found if s is not None]
    else:
        sources = parse_kv_event_specs(spec)
    subscribers = []
    for source in sources:
        if router.pool.get(source.backend) is None:
            log.warning("kv_events names unknown backend %s: ignored", source.backend)
            continue

        def count(kind: str, backend: str = source.backend) -> None:
            metrics.kv_events.labels(backend, kind).inc()

        mirror = RankMirror(source.backend, router.index, hasher, on_event=count)
        subscriber = KVEventSubscriber(mirror, source.endpoint, source.replay_endpoint, source.topic)
        router.set_exact(source.backend)
        subscribers.append(subscriber.start())
        log.info("backend %s: KV events from %s", source.backend, source.endpoint)
    return subscribers
