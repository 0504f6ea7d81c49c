"""The KV-event feeds that keep the prefix index exact: one vLLM KV-event subscription per rank.

``kv_events`` settings: ``auto`` (ask every rank's ``GET /kv_event_sources``), or comma-separated
``NAME=tcp://HOST:PORT`` entries, each optionally followed by ``|tcp://HOST:PORT`` for the replay
socket. A rank fed by events is mirrored exactly (no speculative records or corrections).

Under ``auto`` a rank's source is one of its facts (``routing.rank_facts``), learned each time the
rank becomes healthy and every re-check: ``KVFeeds`` follows them, subscribing to a rank that came up
after prefixgate and again to one that restarted publishing elsewhere. A healthy rank that reports
no source is warned about once (vLLM reports one only when started with ``--kv-events-config``); a
rank that is not up yet is not (it is subscribed when it comes up).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from proxy.ops.metrics import Metrics
from proxy.stages.route import Router
from routing.index import CPU
from routing.kv_events import KVEventSubscriber, RankMirror
from routing.kv_sources import EventSource, parse_kv_event_specs
from routing.rank_facts import RankFacts
from routing.ranks import Rank
from tokenization.block_hash import ChainHasher

log = logging.getLogger("prefixgate.routing")

#: How long start-up waits for the ranks' KV-event feeds to catch up (their replays), all together.
CATCH_UP_S = 5.0


class KVFeeds:
    """This replica's KV-event subscriptions, one per rank, following the ranks' facts under ``auto``."""

    def __init__(self, spec: str, router: Router, hasher: ChainHasher, metrics: Metrics) -> None:
        self.auto = spec.strip() == "auto"
        self.router = router
        self.hasher = hasher
        self.metrics = metrics
        self.subscribers: dict[str, KVEventSubscriber] = {}
        self._sources: dict[str, EventSource] = {}
        #: Healthy ranks already warned about for reporting no source.
        self._warned: set[str] = set()
        self._configured = [] if self.auto else parse_kv_event_specs(spec)

    def start_configured(self) -> list[KVEventSubscriber]:
        """Subscribe to the sources the ``kv_events`` setting names (none under ``auto``)."""
        started = []
        for source in self._configured:
            if self.router.fleet.get(source.rank) is None:
                log.warning("kv_events names unknown rank %s: ignored", source.rank)
                continue
            started.append(self.subscribe(source))
        return started

    def subscribe(self, source: EventSource) -> KVEventSubscriber:
        """Follow ``source`` from now on: its rank's mirror becomes exact (a previous subscription
        of the rank must be stopped first)."""
        metrics, rank = self.metrics, source.rank

        def count(applied: Mapping[str, int]) -> None:
            for kind, events in applied.items():
                metrics.series(metrics.kv_events, rank, kind).inc(events)

        def fault(kind: str, count: int) -> None:
            metrics.kv_event_faults.labels(rank, kind).inc(count)

        # stored blocks are mirrored from then on, no longer in flight
        confirm = self.router.inflight_blocks.confirm
        tier_full = _on_cpu_tier_full(self.router.fleet.get(rank))
        mirror = RankMirror(
            rank, self.router.index, self.hasher, on_applied=count, on_stored=confirm, on_tier_full=tier_full
        )
        subscriber = KVEventSubscriber(
            mirror, source.endpoint, source.replay_endpoint, source.topic, on_fault=fault
        )
        self.router.set_exact(rank)
        self.subscribers[rank] = subscriber.start(wait_s=0)
        self._sources[rank] = source
        log.info("rank %s: KV events from %s", rank, source.endpoint)
        return subscriber

    async def learned(self, rank: Rank, facts: RankFacts) -> None:
        """Under ``auto``: subscribe to the rank's source once known, again when it moved."""
        if not self.auto:
            return
        source = facts.kv_source
        if source is None:
            if rank.healthy and rank.name not in self.subscribers and rank.name not in self._warned:
                self._warned.add(rank.name)
                log.warning(
                    "kv_events auto: rank %s is up but reports no KV-event source (GET /kv_event_sources "
                    "answered none; vLLM reports one when started with --kv-events-config and endpoint "
                    "tcp://*:0), so it is not mirrored exactly",
                    rank.name,
                )
            return
        if self._sources.get(rank.name) == source:
            return
        previous = self.subscribers.pop(rank.name, None)
        if previous is not None:  # the rank restarted publishing elsewhere: its thread ends within 0.1 s
            await asyncio.to_thread(previous.stop)
        self._warned.discard(rank.name)
        self.subscribe(source)

    def missing(self, rank: Rank) -> list[str]:
        if not self.auto or rank.name in self.subscribers:
            return []
        return ["KV-event subscription"]

    def stop(self) -> None:
        for subscriber in self.subscribers.values():
            subscriber.stop()


def _on_cpu_tier_full(rank: Rank | None) -> Callable[[str, int], None] | None:
    """``RankMirror.on_tier_full`` for ``rank``: its CPU tier's size, handed from the subscriber's
    thread to the event loop (``Rank`` changes only there), where admission's budget reads it."""
    if rank is None:
        return None
    loop = asyncio.get_running_loop()

    def learned(medium: str, tokens: int) -> None:
        if medium == CPU:
            loop.call_soon_threadsafe(rank.learned_cpu_tier, tokens)

    return learned


def wait_caught_up(subscribers: list[KVEventSubscriber]) -> None:
    """Wait for every subscriber's replay at once: a fleet's start waits for its slowest, not their
    sum (at most ``CATCH_UP_S`` in all)."""
    deadline = time.monotonic() + CATCH_UP_S
    for subscriber in subscribers:
        if not subscriber.connected.wait(max(0.0, deadline - time.monotonic())):
            rank = subscriber.mirror.rank
            log.warning("rank %s: KV events still catching up after %.0f s", rank, CATCH_UP_S)
