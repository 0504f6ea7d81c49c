"""The configured ranks (the fleet), their health and their load.

Ranks come only from configuration, never from a request. Health is active (a background
``GET /health`` per rank, see ``routing.health``) and passive (a refused connection marks the rank
down at once); a down rank gets no traffic until a health check succeeds again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

log = logging.getLogger("prefixgate.health")


@dataclass(slots=True, eq=False)
class Rank:
    """One vLLM rank as routing sees it. Mutated only from the event loop thread."""

    name: str
    url: str
    pool_tokens: int | None = None
    block_size: int | None = None
    #: The longest context the rank serves (its ``/v1/models`` card's ``max_model_len``), once known.
    max_model_len: int | None = None
    healthy: bool = True
    #: Requests this process sent to the rank and not answered yet.
    in_flight: int = 0
    last_error: str | None = None
    last_checked: float | None = None
    models: list[str] = field(default_factory=list)
    #: The rank keeps the KV blocks its GPU evicts in CPU memory (vLLM's KV offloading): its
    #: ``/metrics`` carry the offload load counters (``routing.rank_metrics``). A session parked
    #: there reloads its context instead of recomputing it (``proxy/admission/rotation.py``).
    offloads_kv: bool = False
    #: The rank's CPU tier, in tokens, once it showed its size: the most CPU blocks its KV events
    #: had it hold when its tier first evicted (``routing.kv_events.RankMirror``; the largest seen
    #: since). None: not shown yet. Admission's budget counts it (``proxy/admission/accounting.py``).
    cpu_tier_tokens: int | None = None
    #: When the rank last went down (None while it is up).
    down_since: float | None = None

    def learned_cpu_tier(self, tokens: int) -> None:
        """The rank's CPU tier held ``tokens`` when it evicted: its size is at least that."""
        known = self.cpu_tier_tokens
        if known is not None and tokens <= known:
            return
        self.cpu_tier_tokens = tokens
        if known is None:
            log.info("rank %s: its CPU tier is full at %d tokens (its first CPU eviction)", self.name, tokens)

    def mark_up(self) -> None:
        now = time.time()
        if not self.healthy:
            since = self.down_since
            log.info(
                "rank %s at %s is healthy again%s (it was down: %s)",
                self.name,
                self.url,
                f" after {now - since:.1f} s" if since is not None else "",
                self.last_error or "unknown reason",
            )
        self.healthy = True
        self.last_error = None
        self.last_checked = now
        self.down_since = None

    def mark_down(self, reason: str) -> None:
        """Take the rank out of routing; logged when it was up (the reason says what failed)."""
        now = time.time()
        if self.healthy:
            log.warning("rank %s at %s is down: %s", self.name, self.url, reason)
            self.down_since = now
        self.healthy = False
        self.last_error = reason
        self.last_checked = now

    def status(self) -> dict[str, object]:
        return {
            "name": self.name,
            "url": self.url,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "pool_tokens": self.pool_tokens,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "cpu_tier_tokens": self.cpu_tier_tokens,
            "last_error": self.last_error,
            "last_checked": self.last_checked,
            "down_since": self.down_since,
        }


class Fleet:
    """The fleet: every configured rank, in configuration order."""

    def __init__(self, ranks: Iterable[Rank]) -> None:
        self._ranks = list(ranks)
        self._by_name = {b.name: b for b in self._ranks}

    def __iter__(self) -> Iterator[Rank]:
        return iter(self._ranks)

    def __len__(self) -> int:
        return len(self._ranks)

    def get(self, name: str) -> Rank | None:
        return self._by_name.get(name)

    def healthy(self, exclude: Iterable[str] = ()) -> list[Rank]:
        excluded = set(exclude)
        return [b for b in self._ranks if b.healthy and b.name not in excluded]
