"""One prefixgate process: its state, its ranks and the pipeline's stages, assembled from the settings.

``Gateway.start`` (the app's lifespan) opens the upstream client, probes every rank once, learns the
healthy ones' facts (``routing.rank_facts``: model, block and pool sizes, KV-event source), builds
the tokenizer, the router (policy, prefix index from the state backend, KV-event feeds), admission and
the pipeline; ``stop`` undoes it. The ranks' facts are learned again each time a rank becomes healthy
and every ``--rank-facts-interval``: what follows from them (the tokenizer, the KV-event feeds, the
index's namespace and bounds) follows (``degraded`` says what is still missing).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aiohttp

from proxy.admission import Admission, RankSpeeds, admission_from_settings
from proxy.config import DEFAULT_IDLE_TTL_S, Settings
from proxy.explain import Explainer
from proxy.fleet_tokenizer import FleetTokenizer
from proxy.loop_lag import LoopLag
from proxy.ops.auth import upstream_auth_headers
from proxy.ops.dashboard import Dashboard
from proxy.ops.limits import Bounds
from proxy.ops.metrics import Metrics
from proxy.pipeline import Pipeline
from proxy.stages.blocks import Blocks
from proxy.stages.canonicalize import Canonicalize
from proxy.stages.forward import Forwarder, upstream_session
from proxy.stages.identify import Identify, Threads
from proxy.stages.parse import Parse
from proxy.stages.route import Pins, Router
from proxy.state.backends import StateBackend, open_state
from proxy.state.index_namespace import IndexNamespace
from proxy.state.kv_feeds import KVFeeds, wait_caught_up
from proxy.state.local import SessionLocal, SessionLocals
from proxy.state.sessions import Session, SessionTable
from routing.health import HealthChecker
from routing.kv_events import KVEventSubscriber
from routing.policies import make_policy, needs_of
from routing.rank_facts import FactBook, RankFacts
from routing.rank_metrics import poll_all, run_metrics_polls
from routing.ranks import Fleet, Rank
from tokenization.block_hash import DEFAULT_BLOCK_SIZE
from tokenization.prompt import IncrementalTokenizer

log = logging.getLogger("prefixgate")


#: Seconds between two warnings that sessions' kept turns were dropped for room (each is counted).
EVICTION_REPORT_S = 60.0


class Gateway:
    """The state of one prefixgate process: ranks, the client to them, the stages and the pipeline."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.loop_lag = LoopLag(self.metrics.registry)
        self.state: StateBackend = open_state(settings)
        #: What this process keeps per session between its turns, for every stage.
        self.locals = SessionLocals(
            budget_bytes=int(settings.session_memory_mb * 1024 * 1024), on_evict=self._session_evicted
        )
        self._evicted_unreported = 0
        self._evictions_reported_at = -EVICTION_REPORT_S
        # the idle TTL until admission has learned one from the traffic (or the configured one)
        self.sessions = SessionTable(self.state.sessions(), settings.session_idle_ttl or DEFAULT_IDLE_TTL_S)
        self.explainer = Explainer(
            self.locals, self.metrics, on_break=self.sessions.add_break, keep_text=settings.log_bodies
        )
        self.dashboard = Dashboard(self.locals)
        self.fleet = Fleet(
            Rank(name=b.name, url=b.url, pool_tokens=b.pool_tokens, block_size=b.block_size)
            for b in settings.backends
        )
        self.client: aiohttp.ClientSession | None = None
        #: New connection per request: for requests whose pooled connection the rank had closed.
        self._fresh_client: aiohttp.ClientSession | None = None
        self.router: Router | None = None
        self.admission: Admission | None = None
        self.pins: Pins | None = None
        self.pipeline: Pipeline | None = None
        self.kv: KVFeeds | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.health: HealthChecker | None = None
        self.facts: FactBook | None = None
        self.tokenizer: FleetTokenizer | None = None
        self.namespace = IndexNamespace(settings.index_namespace, self.state)

    async def start(self) -> None:
        """Open the upstream client (it needs the running loop), probe every rank, build the stages."""
        settings = self.settings
        auth = upstream_auth_headers(settings)
        self.client = client = upstream_session(
            settings.connect_timeout, settings.read_timeout, auth, settings.upstream_keepalive
        )
        self._fresh_client = upstream_session(settings.connect_timeout, settings.read_timeout, auth, None)
        self.health = HealthChecker(self.fleet, settings.health_timeout, auth)
        await self.health.check_all()
        kv_auto = (settings.kv_events or "").strip() == "auto"
        self.facts = facts = FactBook(self.fleet, client, settings.health_timeout, kv_sources=kv_auto)
        await facts.learn_all(self.fleet.healthy())
        model = next((f.model for r in self.fleet.healthy() if (f := facts.facts(r.name)) and f.model), None)
        incremental = None
        if needs_of(settings.policy).blocks:
            self.tokenizer = FleetTokenizer(settings.tokenization, facts, settings.health_timeout)
            incremental = await self.tokenizer.start(self._block_size(), model)
        block_size = (incremental.block_size if incremental is not None else self._block_size()) or (
            DEFAULT_BLOCK_SIZE
        )
        algo = incremental.hasher.algo if incremental is not None else "none"
        # up until a store says otherwise: each one made below is told at once if Redis is down
        if self.state.name == "redis":
            self.metrics.index_redis_up.set(1)
            self.metrics.admission_shared_up.set(1)
        else:  # a 0 would read as an outage: without Redis the gauges are not exported at all
            self.metrics.registry.unregister(self.metrics.index_redis_up)
            self.metrics.registry.unregister(self.metrics.admission_shared_up)
            self.metrics.registry.unregister(self.metrics.redis_writes_queued)
            self.metrics.registry.unregister(self.metrics.redis_write_wait)
            self.metrics.registry.unregister(self.metrics.session_saves_dropped)
        namespace = await self.namespace.first(model)
        index = self.state.prefix_index(namespace, block_size, algo, self._index_state)
        self.pins = Pins(
            self.state.response_ranks(), self.fleet, client, self.locals, settings.health_timeout
        )
        # what the ranks' metrics teach of their prefill speeds: admission weighs its options by
        # them, routing the prefill queued on each rank
        speeds = RankSpeeds()
        self.router = router = Router(
            self.fleet,
            make_policy(settings.policy, balance_factor=settings.balance_factor),
            index,
            block_size=block_size,
            metrics=self.metrics,
            pins=self.pins,
            speeds=speeds,
        )
        if settings.redis_url:  # name a wrong password or a TLS mismatch, not just "unreachable"
            from proxy.state.redis.check import log_redis_problem

            await asyncio.to_thread(log_redis_problem, settings.redis_url, max(settings.redis_timeout, 1.0))
        await self._start_kv_feeds(router, incremental)
        self.admission = admission = admission_from_settings(
            settings,
            self.sessions,
            self.fleet,
            self.metrics,
            block_size,
            router,
            self.state.claims(lambda shared: self.metrics.admission_shared_up.set(1 if shared else 0)),
            speeds,
        )
        # the ranks' context lengths and first figures before the first request
        await poll_all(client, self.fleet, settings.health_timeout, admission.observe_rank)
        threads = Threads(self.locals)
        # A short tail on the loop costs its landing a second index lookup: a dict walk here, a
        # round trip on the event loop with a shared (Redis) index, where it stays on the path.
        local_index = self.state.name == "memory"
        self.pipeline = Pipeline(
            Parse(settings.max_body_bytes, Bounds.from_settings(settings)),
            Identify(self.locals),
            threads,
            Canonicalize.from_settings(not settings.no_canonicalize, settings.canonical, self.metrics),
            blocks := Blocks(incremental, self.locals, local_index, router.exact),
            admission,
            router,
            Forwarder(
                client,
                self.metrics,
                settings.retries,
                fresh=self._fresh_client,
                first_byte_timeout=settings.first_byte_timeout,
            ),
            self.pins,
            self.explainer,
            self.dashboard.recorder,
            self.metrics,
            debug_headers=settings.debug_headers,
        )
        if self.tokenizer is not None:  # a tokenizer found later replaces the one the stage has
            self.tokenizer.on_replace = lambda found: setattr(blocks, "incremental", found)
            facts.follow(self.tokenizer)
        facts.follow(self.namespace)
        facts.follow(_IndexBounds(router))
        self.health.on_up = facts.rank_up  # from now on: a rank that comes up is learned then
        self._tasks = [
            asyncio.create_task(self.health.run(settings.health_interval)),
            asyncio.create_task(facts.run(settings.rank_facts_interval)),
            asyncio.create_task(self._refresh_admission(admission)),
            asyncio.create_task(
                run_metrics_polls(
                    client,
                    self.fleet,
                    settings.health_interval,
                    settings.health_timeout,
                    admission.observe_rank,
                    speeds.sooner,
                )
            ),
            asyncio.create_task(self.loop_lag.run()),
        ]
        for rank in self.fleet:
            state = "healthy" if rank.healthy else f"DOWN ({rank.last_error})"
            log.info("rank %s at %s: %s", rank.name, rank.url, state)

    def _session_evicted(self, local: SessionLocal) -> None:
        """A session's kept turns were dropped to make room: counted, and said at most once a
        ``EVICTION_REPORT_S`` (an operator sizing ``--session-memory-mb`` needs the idle time of what
        goes: seconds mean the budget is too small for the sessions in play)."""
        self.metrics.session_evictions.inc()
        self._evicted_unreported += 1
        now = time.monotonic()
        if now - self._evictions_reported_at < EVICTION_REPORT_S:
            return
        idle = f"{time.time() - local.last_seen:.1f} s" if local.last_seen else "never used"
        log.warning(
            "session memory full (--session-memory-mb %g): %d sessions' kept turns dropped to make "
            "room, the latest idle %s; their next turns are tokenized whole. Raise "
            "--session-memory-mb if sessions idle that briefly are still in play",
            self.settings.session_memory_mb,
            self._evicted_unreported,
            idle,
        )
        self._evicted_unreported = 0
        self._evictions_reported_at = now

    @property
    def kv_feeds(self) -> tuple[KVEventSubscriber, ...]:
        """The ranks' KV-event subscriptions of this replica (a read, for inspection)."""
        return tuple(self.kv.subscribers.values()) if self.kv is not None else ()

    def degraded(self) -> dict[str, list[str]]:
        """What is still missing, per healthy rank: facts not learned yet, or not followed yet (the
        tokenizer, the KV-event subscription, ...); empty when everything is known."""
        if self.facts is None:
            return {}
        missing = {rank.name: self.facts.missing(rank) for rank in self.fleet.healthy()}
        return {name: gaps for name, gaps in missing.items() if gaps}

    async def stop(self) -> None:
        if self.facts is not None:
            self.facts.stop()
        if self.kv is not None:
            self.kv.stop()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.health is not None:
            self.health.close()
        for client in (self.client, self._fresh_client):
            if client is not None:
                await client.close()
        if self.tokenizer is not None:
            await self.tokenizer.close()
        self.state.close()

    def end_session(self, key: str) -> Session | None:
        """End a session at once (``DELETE /admin/sessions/{id}``): its budget is free for the queue
        and everything this process kept for it is gone (its local state, its stored answers' ids,
        its rank binding in the prefix index)."""
        assert self.admission is not None and self.router is not None and self.pins is not None
        session = self.admission.release(key)
        local = self.locals.end(key)
        if local is not None:
            self.pins.forget(list(local.response_ids))
        self.router.index.forget_session(key)
        return session

    def threads_of(self, key: str) -> list[dict[str, object]]:
        """The threads this process holds for session ``key`` (main first, then by first request)."""
        local = self.locals.get(key)
        if local is None:
            return []
        threads = sorted(local.threads.values(), key=lambda t: (t.kind != "main", t.first_seen))
        return [t.to_dict() for t in threads]

    # -- assembly ---------------------------------------------------------------------------------

    def _index_state(self, up: bool) -> None:
        self.metrics.index_redis_up.set(1 if up else 0)
        if up:
            log.info("redis is reachable again: prefix index resynchronized")
        else:
            log.warning("redis unreachable: routing from the local mirror until it returns")

    async def _refresh_admission(self, admission: Admission) -> None:
        """Apply what time changes to admission's accounting (sessions idling out, reservations
        expiring), whether or not requests arrive."""
        while True:
            await asyncio.sleep(admission.poll_interval())
            admission.refresh()

    def _block_size(self) -> int | None:
        sizes = {r.block_size for r in self.fleet if r.block_size}
        if len(sizes) > 1:
            log.warning("ranks report different block sizes %s: using %d", sorted(sizes), min(sizes))
        return min(sizes) if sizes else None

    async def _start_kv_feeds(self, router: Router, incremental: IncrementalTokenizer | None) -> None:
        """Subscribe to the KV events the ``kv_events`` setting names, or under ``auto`` to the healthy
        ranks' sources (the others' once they come up: ``KVFeeds`` follows the facts), and wait for
        them to catch up (off the event loop)."""
        spec = self.settings.kv_events
        if not spec:
            return
        if incremental is None:
            log.warning("kv_events needs the blocks stage (a prefix-aware policy): not subscribing")
            return
        assert self.facts is not None
        self.kv = kv = KVFeeds(spec, router, incremental.hasher, self.metrics)
        kv.start_configured()
        for rank in self.fleet.healthy():
            await kv.learned(rank, self.facts.facts(rank.name) or RankFacts())
        self.facts.follow(kv)
        await asyncio.to_thread(wait_caught_up, list(kv.subscribers.values()))
        for rank in self.fleet if kv.auto else ():
            if not rank.healthy:  # not vLLM's flags: the rank is not up yet
                log.info(
                    "kv_events auto: rank %s is not up yet; its KV events are followed once it is", rank.name
                )


class _IndexBounds:
    """Keeps the prefix index's bound on each rank at its pool, as the pool is learned or changes."""

    def __init__(self, router: Router) -> None:
        self.router = router

    async def learned(self, rank: Rank, facts: RankFacts) -> None:
        self.router.set_exact(rank.name, rank.name in self.router.exact)  # sets the bound again

    def missing(self, rank: Rank) -> list[str]:
        return []
