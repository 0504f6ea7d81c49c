"""The blocks stage's tokenizer, following the ranks: found at start, found again when a rank tells more.

With ``tokenization: {kind: auto}`` (the default) the tokenizer is the served model's, found by
asking a healthy rank (``tokenization.discover``). A fleet whose ranks were not up at start gets the
embedded one until a rank comes up: its facts (``routing.rank_facts``) then bring the served
model's tokenizer, built off the event loop (a Hugging Face tokenizer takes a second or more to
load) and swapped into the blocks stage. It is found again when no healthy rank serves the model
it was found for any more (a rank restarted with another model). A configured tokenizer is kept.

The blocks are hashed with the block size fixed at start (the router, admission and the index
count in it): a rank that reports another one is logged, and ``/ready`` names it until restarted.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from routing.rank_facts import FactBook, RankFacts
from routing.ranks import Fleet, Rank
from tokenization.config import TokenizerConfig
from tokenization.discover import Discovery, discover
from tokenization.factory import build_incremental
from tokenization.prompt import IncrementalTokenizer

log = logging.getLogger("prefixgate")


class FleetTokenizer:
    """Builds the blocks stage's ``IncrementalTokenizer`` and replaces it as the ranks' facts change
    (``on_replace``: told the new one, on the event loop)."""

    def __init__(self, settings_section: dict[str, object], book: FactBook, timeout: float) -> None:
        self.config = TokenizerConfig.model_validate(settings_section)
        self.book = book
        self.fleet: Fleet = book.fleet
        self.timeout = timeout
        self.client = book.client  # the process's client to its ranks: its pool, its upstream key
        # First turns' encoding in threads of their own, one per core (tiktoken and HF tokenizers
        # release the GIL while encoding): never queued behind other blocking work.
        self.pool = ThreadPoolExecutor(self.config.worker_threads, thread_name_prefix="prefixgate-tokenize")
        self.current: IncrementalTokenizer | None = None
        #: The rank the tokenizer was found by asking, and the model it serves (None: no rank asked).
        self.asked: str | None = None
        self.model: str | None = None
        self.on_replace: Callable[[IncrementalTokenizer], None] | None = None
        self._finding: asyncio.Task[None] | None = None
        #: Ranks whose block size was reported as differing from the one in use.
        self._mismatched: dict[str, int] = {}

    @property
    def follows(self) -> bool:
        return self.config.kind == "auto"

    async def start(self, block_size: int | None, model: str | None) -> IncrementalTokenizer:
        """The tokenizer to start with: as configured, or the served model's if a rank is healthy."""
        healthy = self.fleet.healthy()
        rank = healthy[0] if healthy else None
        if self.follows:
            self.current = await self._find(rank, block_size, model)
        else:
            log.info("tokenizer: %s, as configured (tokenization.kind)", self.config.kind)
            self.current = self._build(self.config, block_size, rank, model)
        await self.current.prepare_threads(self.config.worker_threads)
        return self.current

    async def learned(self, rank: Rank, facts: RankFacts) -> None:
        current = self.current
        if current is None:
            return
        self._check_block_size(rank, current.block_size)
        if not self.follows or not rank.healthy or (self._finding and not self._finding.done()):
            return
        served = {f.model for r in self.fleet.healthy() if (f := self.book.facts(r.name)) and f.model}
        if self.asked is not None and (self.model is None or self.model in served):
            return
        self._finding = asyncio.current_task()
        found = await self._find(rank, current.block_size, facts.model)
        self.current = found
        if self.on_replace is not None:
            self.on_replace(found)

    def missing(self, rank: Rank) -> list[str]:
        gaps = ["tokenizer"] if self.follows and self.asked is None else []
        if rank.name in self._mismatched and self.current is not None:
            gaps.append(f"block size {self.current.block_size} (it has {self._mismatched[rank.name]})")
        return gaps

    async def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    # -- finding and building ---------------------------------------------------------------------

    async def _find(
        self, rank: Rank | None, block_size: int | None, model: str | None
    ) -> IncrementalTokenizer:
        found: Discovery = await discover(
            self.config, self.client, rank.url if rank is not None else None, timeout=self.timeout
        )
        asked = f" (asked rank {rank.name})" if rank is not None else ""
        (log.warning if found.warn else log.info)("tokenizer: %s%s", found.reason, asked)
        # a Hugging Face tokenizer loads for a second or more: never on the event loop
        built = await asyncio.to_thread(self._build, found.config, block_size, rank, found.model)
        await built.prepare_threads(self.config.worker_threads)
        self.asked = rank.name if rank is not None else None
        self.model = model or found.model
        return built

    def _build(
        self, config: TokenizerConfig, block_size: int | None, rank: Rank | None, model: str | None
    ) -> IncrementalTokenizer:
        base = rank or next(iter(self.fleet), None)
        return build_incremental(
            config,
            block_size=block_size,
            client=self.client,
            base_url=base.url if base is not None else None,
            model=model,
            executor=self.pool,
        )

    def _check_block_size(self, rank: Rank, in_use: int) -> None:
        reported = rank.block_size
        if reported is None or reported == in_use:
            self._mismatched.pop(rank.name, None)
            return
        if self._mismatched.get(rank.name) != reported:
            log.warning(
                "rank %s has KV blocks of %d tokens but prefixgate hashes blocks of %d, fixed at start: "
                "its prefix matches are wrong until prefixgate restarts (or set tokenization.block_size)",
                rank.name,
                reported,
                in_use,
            )
        self._mismatched[rank.name] = reported
