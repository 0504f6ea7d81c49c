"""The in-process state of one simulated rank: engine, prompt caches, KV-event publisher, faults."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from bench.sim.config import SimConfig
from bench.sim.faults import Faults
from bench.sim.kv_events import KVEventPublisher
from bench.sim.prompts import PromptProcessor
from bench.sim.scheduler import Engine
from tokenization.tiktoken_tokenizer import chatml_encoding


class SimRank:
    """The in-process state of one rank: engine (pool, scheduler, counters), prompt caches, faults.

    Create and use it on the event loop that serves it.
    """

    def __init__(
        self, config: SimConfig, on_refuse_change: Callable[[bool], Awaitable[None]] | None = None
    ) -> None:
        self.config = config
        self.name = config.name
        self.publisher: KVEventPublisher | None = None
        if config.kv_events:
            self.publisher = KVEventPublisher(
                host=config.host,
                port=config.kv_events_port,
                replay_port=config.kv_replay_port,
                topic=config.kv_events_topic,
                version=config.kv_events_version,
                data_parallel_rank=config.data_parallel_rank,
            )
        self.engine = Engine(config, self.publisher.publish if self.publisher else None)
        self.pool = self.engine.pool
        self.counters = self.engine.counters
        self.processor = PromptProcessor(self.engine.hasher)
        chatml_encoding()  # built once per process (~0.2 s): not inside the first request's timing
        self.faults = Faults(config.faults, on_refuse_change)
        self.created = int(time.time())
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the engine's step loop on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self.engine.run(), name=f"{self.name}-engine")

    async def stop(self) -> None:
        """Stop the step loop and close the KV-event sockets."""
        self.engine.stop()
        if self._task is not None:
            await asyncio.wait([self._task], timeout=5)
        if self.publisher is not None:
            await asyncio.to_thread(self.publisher.close)

    @property
    def alive(self) -> bool:
        """True while the engine's step loop runs (``/health``)."""
        return self._task is not None and not self._task.done()

    def state(self) -> dict[str, Any]:
        """Engine state, fault knobs and prompt-cache counters, for ``GET /sim/state``."""
        return {
            "name": self.name,
            **self.engine.state(),
            "faults": self.faults.config.as_dict(),
            "prompt_cache": {
                "segments_encoded": self.processor.segments_encoded,
                "blocks_hashed": self.processor.blocks_hashed,
            },
        }
