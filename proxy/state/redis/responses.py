"""``responses.ResponseRanks`` in Redis: every replica finds the rank that stored a response, with a
local copy for when Redis is down."""

from __future__ import annotations

from typing import Any

from proxy.state.redis.link import RedisLink
from proxy.state.redis.topology import reply_text
from proxy.state.responses import MemoryResponseRanks

#: How long Redis keeps a response id's rank (vLLM's in-memory store has no expiry; a week bounds it).
REDIS_TTL_S = 7 * 24 * 3600
REDIS_PREFIX = "prefixgate:response:"


class RedisResponseRanks:
    """Response id -> rank name in Redis (shared by replicas), with a local copy for when it is down.

    Behind the ``RedisLink`` shared with the other stores on that Redis: while its circuit is open,
    the local copy answers and Redis is not tried; the copy is pushed back when Redis returns.
    """

    def __init__(
        self,
        client: Any,
        ttl: int = REDIS_TTL_S,
        local: MemoryResponseRanks | None = None,
        link: RedisLink | None = None,
    ) -> None:
        self.link = link or RedisLink(client, name="redis response map")
        self.client = self.link.client
        self.ttl = ttl
        self.local = local or MemoryResponseRanks()
        self.link.on_resync(self.resync)

    def get(self, response_id: str) -> str | None:
        rank = self.local.get(response_id)
        if rank is not None:
            return rank
        value = self.link.call(lambda: self.client.get(REDIS_PREFIX + response_id))
        if value is None:
            return None
        rank = reply_text(value)
        self.local.put(response_id, rank)
        return rank

    def put(self, response_id: str, rank: str) -> None:
        self.local.put(response_id, rank)
        self.link.call(lambda: self.client.set(REDIS_PREFIX + response_id, rank, ex=self.ttl))

    def forget(self, response_id: str) -> None:
        self.local.forget(response_id)
        self.link.call(lambda: self.client.delete(REDIS_PREFIX + response_id))

    def resync(self) -> None:
        """Push the local copy back (ids Redis lacks only). Raises on Redis errors."""
        pipe = self.client.pipeline(transaction=False)
        for count, response_id in enumerate(self.local, 1):
            rank = self.local.peek(response_id)
            if rank is not None:
                pipe.set(REDIS_PREFIX + response_id, rank, ex=self.ttl, nx=True)
            if count % 1000 == 0:
                pipe.execute()
        pipe.execute()
