"""One prefixgate process: its state, its ranks and the pipeline's stages, assembled from the settings.

``Gateway.start`` (the app's lifespan) opens the upstream client, probes every rank once, learns
block and pool sizes from ``vllm:cache_config_info``, builds the tokenizer, the router (policy,
prefix index from the state backend, KV-event feeds), admission and the pipeline; ``stop`` undoes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import httpx

from proxy.admission import Admission, RankSpeeds, admission_from_settings
from proxy.admission.config import DEFAULT_IDLE_TTL_S
from proxy.config import Settings
from proxy.explain import Explainer
from proxy.loop_lag import LoopLag
from proxy.ops.auth import upstream_auth_headers
from proxy.ops.dashboard import Dashboard
from proxy.ops.limits import Bounds
from proxy.ops.metrics import Metrics
from proxy.ops.models import fetch_models
from proxy.pipeline import Pipeline
from proxy.stages.blocks import Blocks
from proxy.stages.canonicalize import Canonicalize
from proxy.stages.forward import Forwarder, upstream_session
from proxy.stages.identify import Identify
from proxy.stages.observe import Observers, UsageMetrics
from proxy.stages.parse import Parse
from proxy.stages.pin import Pins
from proxy.stages.route import DEFAULT_BLOCK_SIZE, Router
from proxy.stages.threads import Threads
from proxy.state import StateBackend, open_state
from proxy.state.kv_feeds import start_kv_event_feeds
from proxy.state.load_share import LoadShare, LocalShare, share_interval
from proxy.state.local import SessionLocal, SessionLocals
from proxy.state.sessions import Session, SessionTable
from routing.health import HealthChecker
from routing.kv_events import KVEventSubscriber
from routing.policies import make_policy, needs_of
from routing.rank_metrics import poll_all, run_metrics_polls
from routing.ranks import Fleet, Rank
from tokenization.backend_info import block_size_of, parse_cache_config_info
from tokenization.config import TokenizerConfig
from tokenization.discover import discover
from tokenization.factory import build_incremental
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
        self._kv_feeds: list[KVEventSubscriber] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._load_share: LoadShare | None = None
        self._tokenizer_client: httpx.AsyncClient | None = None
        self.health: HealthChecker | None = None
        self._tokenizer_pool: ThreadPoolExecutor | None = None

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
        await asyncio.gather(*(self._learn_cache_config(r) for r in self.fleet if r.healthy))
        incremental = await self._incremental_tokenizer()
        block_size = (incremental.block_size if incremental is not None else self._block_size()) or (
            DEFAULT_BLOCK_SIZE
        )
        algo = incremental.hasher.algo if incremental is not None else "none"
        index = self.state.prefix_index(await self._model_name(), block_size, algo, self._index_state)
        if self.state.name == "redis":
            self.metrics.index_redis_up.set(1)
            self.metrics.admission_shared_up.set(1)
            self.metrics.admission_queue_shared_up.set(1)
        else:  # a 0 would read as an outage: without Redis the gauges are not exported at all
            self.metrics.registry.unregister(self.metrics.index_redis_up)
            self.metrics.registry.unregister(self.metrics.admission_shared_up)
            self.metrics.registry.unregister(self.metrics.admission_queue_shared_up)
            self.metrics.registry.unregister(self.metrics.redis_writes_queued)
            self.metrics.registry.unregister(self.metrics.redis_write_wait)
            self.metrics.registry.unregister(self.metrics.session_saves_dropped)
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
            from proxy.ops.redis_check import log_redis_problem

            await asyncio.to_thread(log_redis_problem, settings.redis_url, max(settings.redis_timeout, 1.0))
        hasher = incremental.hasher if incremental is not None else None
        self._kv_feeds = await start_kv_event_feeds(settings.kv_events, client, router, hasher, self.metrics)
        self.admission = admission = admission_from_settings(
            settings,
            self.sessions,
            self.fleet,
            self.metrics,
            block_size,
            router,
            self.state.claims(lambda shared: self.metrics.admission_shared_up.set(1 if shared else 0)),
            self.state.wait_order(
                lambda shared: self.metrics.admission_queue_shared_up.set(1 if shared else 0)
            ),
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
            Blocks(incremental, self.locals, lambda: local_index and not router.exact),
            admission,
            router,
            Forwarder(
                client,
                self.metrics,
                settings.retries,
                fresh=self._fresh_client,
                first_byte_timeout=settings.first_byte_timeout,
            ),
            Observers(
                [
                    UsageMetrics(self.metrics),
                    threads,
                    admission,
                    self.dashboard.recorder,
                    self.explainer,
                    router,
                    self.pins,
                ]
            ),
            self.pins,
            self.metrics,
            debug_headers=settings.debug_headers,
        )
        self._tasks = [
            asyncio.create_task(self.health.run(settings.health_interval)),
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
        share = self.state.load_share()
        if not isinstance(share, LocalShare):  # a lone process has no other replica's load to read
            self._load_share = share
            self._tasks.append(asyncio.create_task(self._share_load(share, router)))
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
        return tuple(self._kv_feeds)

    async def stop(self) -> None:
        for feed in self._kv_feeds:
            feed.stop()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._load_share is not None:  # its load stops counting at once, not when stale
            await asyncio.to_thread(self._load_share.leave)
        if self.health is not None:
            self.health.close()
        for client in (self.client, self._fresh_client):
            if client is not None:
                await client.close()
        if self._tokenizer_client is not None:
            await self._tokenizer_client.aclose()
        if self._tokenizer_pool is not None:
            self._tokenizer_pool.shutdown(wait=False, cancel_futures=True)
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

    async def _share_load(self, share: LoadShare, router: Router) -> None:
        """This replica's load on the ranks out and the other replicas' in, every ``share_interval``
        (off the event loop: a round trip to Redis)."""
        while True:
            own = router.own_load()
            others = await asyncio.to_thread(share.exchange, own)
            router.share_load(others)
            await asyncio.sleep(share_interval(own, others))

    async def _refresh_admission(self, admission: Admission) -> None:
        """Apply what time changes to admission's accounting (sessions idling out, reservations
        expiring), whether or not requests arrive."""
        while True:
            await asyncio.sleep(admission.poll_interval())
            admission.refresh()

    async def _learn_cache_config(self, rank: Rank) -> None:
        """Block size and pool size from the rank's ``vllm:cache_config_info``, where not configured."""
        assert self.client is not None
        timeout = aiohttp.ClientTimeout(total=self.settings.health_timeout)
        try:
            async with self.client.get(f"{rank.url}/metrics", timeout=timeout) as response:
                info = parse_cache_config_info((await response.read()).decode("utf-8", "replace"))
        except (aiohttp.ClientError, TimeoutError):
            return
        block_size = block_size_of(info)
        if rank.block_size is None and block_size is not None:
            rank.block_size = block_size
        blocks = info.get("num_gpu_blocks", "")
        if rank.pool_tokens is None and blocks.isdigit() and rank.block_size:
            rank.pool_tokens = int(blocks) * rank.block_size

    def _block_size(self) -> int | None:
        sizes = {r.block_size for r in self.fleet if r.block_size}
        if len(sizes) > 1:
            log.warning("ranks report different block sizes %s: using %d", sorted(sizes), min(sizes))
        return min(sizes) if sizes else None

    async def _model_name(self) -> str:
        """The served model's name (namespaces the shared index), from the first rank that says."""
        assert self.client is not None
        for rank in self.fleet.healthy():
            cards = await fetch_models(self.client, rank, self.settings.health_timeout)
            if cards and isinstance(cards[0], dict) and isinstance(cards[0].get("id"), str):
                return str(cards[0]["id"])
        return "default"

    async def _incremental_tokenizer(self) -> IncrementalTokenizer | None:
        """The tokenizer of the blocks stage, when the routing policy uses prefix blocks: as
        configured, or (``kind: auto``) the served model's, found at start (one log line says which)."""
        if not needs_of(self.settings.policy).blocks:
            return None
        config = TokenizerConfig.model_validate(self.settings.tokenization)
        healthy = self.fleet.healthy()
        rank = healthy[0] if healthy else next(iter(self.fleet), None)
        self._tokenizer_client = client = httpx.AsyncClient(trust_env=False)
        model = None
        if config.kind == "auto":
            url = healthy[0].url if healthy else None
            found = await discover(config, client, url, timeout=self.settings.health_timeout)
            config, model = found.config, found.model
            (log.warning if found.warn else log.info)("tokenizer: %s", found.reason)
        else:
            log.info("tokenizer: %s, as configured (tokenization.kind)", config.kind)
        base_url = rank.url if rank is not None else None
        # First turns' encoding in threads of their own, one per core (tiktoken and HF tokenizers
        # release the GIL while encoding): never queued behind other blocking work.
        self._tokenizer_pool = pool = ThreadPoolExecutor(
            config.worker_threads, thread_name_prefix="prefixgate-tokenize"
        )
        return build_incremental(
            config,
            block_size=self._block_size(),
            client=client,
            base_url=base_url,
            model=model,
            executor=pool,
        )
