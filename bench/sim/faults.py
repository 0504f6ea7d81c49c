"""Run-time fault state of a simulated rank (the knobs are :class:`bench.sim.config.FaultConfig`).

Lives on the server's event loop; other threads change it through ``SimRankServer.set_faults``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from typing import Any

from bench.sim.config import FaultConfig


class DropConnection(Exception):
    """Raised inside a response to make the server drop the connection without completing it."""


class Faults:
    """Current knobs plus what they need at run time (random draws, waiting out a hang)."""

    def __init__(
        self, config: FaultConfig, on_refuse_change: Callable[[bool], Awaitable[None]] | None = None
    ) -> None:
        self.config = config
        self._rng = random.Random(config.seed)
        self._unhung = asyncio.Event()
        self._unhung.set()
        self._on_refuse_change = on_refuse_change
        self._listen_again: asyncio.TimerHandle | None = None
        self._pending: asyncio.Task[FaultConfig] | None = None
        if config.hang:
            self._unhung.clear()

    async def update(self, **knobs: Any) -> FaultConfig:
        """Change knobs (unknown names raise ValueError); clearing ``hang`` releases waiting requests."""
        old = self.config
        new = old.updated(**knobs)
        self.config = new
        if new.seed != old.seed:
            self._rng = random.Random(new.seed)
        if new.hang:
            self._unhung.clear()
        else:
            self._unhung.set()
        if new.refuse_connections != old.refuse_connections and self._on_refuse_change is not None:
            await self._on_refuse_change(new.refuse_connections)
        if self._listen_again is not None:
            self._listen_again.cancel()
            self._listen_again = None
        if new.refuse_connections and new.refuse_for_s is not None:
            loop = asyncio.get_running_loop()
            self._listen_again = loop.call_later(new.refuse_for_s, self._stop_refusing, loop)
        return new

    def _stop_refusing(self, loop: asyncio.AbstractEventLoop) -> None:
        """``refuse_for_s`` is over: listen again (and forget the duration, so the state reads clean)."""
        self._listen_again = None
        task = loop.create_task(self.update(refuse_connections=False, refuse_for_s=None))
        self._pending = task  # held: the loop keeps only a weak reference to a task

    async def before_request(self) -> bool:
        """Apply hang and latency; True when this request must be answered with an error."""
        cfg = self.config
        if cfg.hang:
            await self._unhung.wait()
            cfg = self.config
        if cfg.latency_s > 0:
            await asyncio.sleep(cfg.latency_s)
        return cfg.error_rate > 0 and self._rng.random() < cfg.error_rate
