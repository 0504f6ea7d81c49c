"""What prefixgate knows of each rank, and when it learns it.

A rank's facts: the model it serves (``GET /v1/models``), its KV block size and pool size
(``vllm:cache_config_info`` on ``GET /metrics``) and, when asked for (``--kv-events auto``), where it
publishes its KV-cache events (``GET /kv_event_sources``). vLLM takes minutes to load a model and
deployments start prefixgate first, so nothing is learned once for good: the facts are read each time
a rank becomes healthy (unknown or down, then up: the health checker's ``on_up``), and again every
``interval`` seconds for every healthy rank, since a rank may restart with another model or pool
between two health checks. Each change is logged in one sentence naming the rank.

A fact the rank does not report this time (it did not answer, or its answer lacks it) keeps its last
value; a configured ``pool_tokens`` or ``block_size`` always wins over the rank's. What follows from
the facts (the tokenizer, the KV-event subscriptions, the shared index's namespace, the index's
bound) is done by ``Follower``s, told after each learning; each also says what it still misses for a
rank, and ``missing`` gathers everything ``/ready`` reports as degraded.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import aiohttp
import orjson

from routing.kv_sources import EventSource, discover_source
from routing.ranks import Fleet, Rank
from tokenization.backend_info import block_size_of, parse_cache_config_info

log = logging.getLogger("prefixgate.ranks")


@dataclass(frozen=True, slots=True)
class RankFacts:
    """What one reading of a rank found (None: not reported)."""

    model: str | None = None
    block_size: int | None = None
    #: The pool in blocks, as the rank reports it (``num_gpu_blocks``).
    pool_blocks: int | None = None
    kv_source: EventSource | None = None

    def over(self, before: RankFacts | None) -> RankFacts:
        """These facts, with ``before``'s where this reading found none."""
        if before is None:
            return self
        return RankFacts(
            self.model or before.model,
            self.block_size or before.block_size,
            self.pool_blocks or before.pool_blocks,
            self.kv_source or before.kv_source,
        )


class Follower(Protocol):
    """Something that follows the ranks' facts (the tokenizer, the KV-event feeds, ...)."""

    async def learned(self, rank: Rank, facts: RankFacts) -> None:
        """``rank``'s facts were just read (changed or not); called on the event loop."""
        ...

    def missing(self, rank: Rank) -> list[str]:
        """What this follower still lacks for ``rank``, in a few words each (empty: nothing)."""
        ...


async def _get(client: aiohttp.ClientSession, url: str, timeout: float) -> bytes | None:
    try:
        async with client.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            return await response.read() if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None


async def read_facts(client: aiohttp.ClientSession, rank: Rank, timeout: float, kv_source: bool) -> RankFacts:
    """One reading of ``rank``'s facts (its three endpoints asked at once)."""
    metrics, models, source = await asyncio.gather(
        _get(client, f"{rank.url}/metrics", timeout),
        _get(client, f"{rank.url}/v1/models", timeout),
        discover_source(client, rank.name, rank.url, timeout) if kv_source else asyncio.sleep(0),
    )
    info = parse_cache_config_info(metrics.decode("utf-8", "replace")) if metrics else {}
    blocks = info.get("num_gpu_blocks", "")
    return RankFacts(
        _model_of(models),
        block_size_of(info),
        int(blocks) if blocks.isdigit() and int(blocks) > 0 else None,
        source if isinstance(source, EventSource) else None,
    )


def _model_of(body: bytes | None) -> str | None:
    """The first model card's ``id`` in a ``/v1/models`` answer."""
    try:
        cards = orjson.loads(body).get("data") if body else None
    except (orjson.JSONDecodeError, AttributeError):
        return None
    first = cards[0] if isinstance(cards, list) and cards else None
    model = first.get("id") if isinstance(first, dict) else None
    return model if isinstance(model, str) and model else None


class FactBook:
    """Every rank's facts, learned on ``rank_up`` and every ``interval`` (``run``), and applied to the
    fleet's ``Rank`` objects (``block_size``, ``pool_tokens``: admission and routing read them there)."""

    def __init__(
        self, fleet: Fleet, client: aiohttp.ClientSession, timeout: float, *, kv_sources: bool = False
    ) -> None:
        """``kv_sources``: ask each rank where it publishes KV events (``--kv-events auto``)."""
        self.fleet = fleet
        self.client = client
        self.timeout = timeout
        self.kv_sources = kv_sources
        self.followers: list[Follower] = []
        self._facts: dict[str, RankFacts] = {}
        # what the configuration fixed is never overwritten by what a rank reports
        self._pool_configured = {r.name for r in fleet if r.pool_tokens is not None}
        self._block_configured = {r.name for r in fleet if r.block_size is not None}
        self._learning: dict[str, asyncio.Task[None]] = {}

    def facts(self, rank: str) -> RankFacts | None:
        """What was last learned of ``rank`` (None: it was never read)."""
        return self._facts.get(rank)

    def follow(self, follower: Follower) -> None:
        self.followers.append(follower)

    async def learn(self, rank: Rank) -> RankFacts:
        """Read ``rank``'s facts, apply them, log what changed and tell the followers."""
        before = self._facts.get(rank.name)
        facts = (await read_facts(self.client, rank, self.timeout, self.kv_sources)).over(before)
        self._facts[rank.name] = facts
        changes = self._apply(rank, facts) + _changes(before, facts, rank)
        if changes:
            log.info("rank %s %s", rank.name, _sentence(changes, first=before is None))
        for follower in self.followers:
            try:
                await follower.learned(rank, facts)
            except Exception:  # one follower's failure must not keep the others from the facts
                log.exception("following rank %s's facts failed in %s", rank.name, type(follower).__name__)
        return facts

    async def learn_all(self, ranks: Iterable[Rank]) -> None:
        await asyncio.gather(*(self.learn(rank) for rank in ranks))

    def rank_up(self, rank: Rank) -> None:
        """The health checker's ``on_up``: ``rank`` just became healthy; its facts are read now (in a
        task of their own: the health round goes on), unless a reading is already under way."""
        if not self._reading(rank):
            self._learning[rank.name] = asyncio.create_task(self._learn_in_background(rank))

    def _reading(self, rank: Rank) -> bool:
        running = self._learning.get(rank.name)
        return running is not None and not running.done()

    async def _learn_in_background(self, rank: Rank) -> None:
        """``learn`` as a task's body (its facts are kept here, not returned)."""
        await self.learn(rank)

    async def run(self, interval: float) -> None:
        """Forever: every ``interval`` seconds, read every healthy rank's facts again."""
        while True:
            await asyncio.sleep(interval)
            await self.learn_all(rank for rank in self.fleet.healthy() if not self._reading(rank))

    def missing(self, rank: Rank) -> list[str]:
        """What is still unknown of ``rank``, or not yet followed (empty: everything is known)."""
        facts = self._facts.get(rank.name) or RankFacts()
        own = [
            name
            for name, known in (
                ("model", facts.model),
                ("block size", rank.block_size),
                ("pool size", rank.pool_tokens),
            )
            if not known
        ]
        return own + [item for follower in self.followers for item in follower.missing(rank)]

    def stop(self) -> None:
        for task in self._learning.values():
            task.cancel()

    def _apply(self, rank: Rank, facts: RankFacts) -> list[str]:
        """Set the rank's block and pool sizes from ``facts`` where not configured; what changed, as
        phrases (a first value is no change: ``_changes`` says it)."""
        changes = []
        block_size = facts.block_size
        if rank.name not in self._block_configured and block_size and block_size != rank.block_size:
            if rank.block_size is not None:
                changes.append(f"has KV blocks of {block_size} tokens now (was {rank.block_size})")
            rank.block_size = block_size
        if rank.name not in self._pool_configured and facts.pool_blocks and rank.block_size:
            pool = facts.pool_blocks * rank.block_size
            if pool != rank.pool_tokens:
                if rank.pool_tokens is not None:
                    changes.append(f"has a KV pool of {pool:,} tokens now (was {rank.pool_tokens:,})")
                rank.pool_tokens = pool
        return changes


def _changes(before: RankFacts | None, after: RankFacts, rank: Rank) -> list[str]:
    """The model and KV-event source changes between two readings; for a first reading, all that is
    known of the rank."""
    if before is None:
        known = [f"serves model {after.model}"] if after.model else []
        if rank.block_size:
            known.append(f"has KV blocks of {rank.block_size} tokens")
        if rank.pool_tokens:
            known.append(f"has a KV pool of {rank.pool_tokens:,} tokens")
        if after.kv_source:
            known.append(f"publishes KV events at {after.kv_source.endpoint}")
        return known
    changes = []
    if after.model != before.model and after.model:
        was = f" (was {before.model})" if before.model else ""
        changes.append(f"serves model {after.model} now{was}")
    if after.kv_source != before.kv_source and after.kv_source:
        was = f" (was {before.kv_source.endpoint})" if before.kv_source else ""
        changes.append(f"publishes KV events at {after.kv_source.endpoint} now{was}")
    return changes


def _sentence(phrases: list[str], first: bool) -> str:
    """``a, b and c``; a first reading says it is one."""
    said = phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
    return f"{said} (first reading)" if first else said
