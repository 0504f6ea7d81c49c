"""Response id -> rank: a Responses request continuing a stored answer (``previous_response_id``)
and a retrieval must reach the rank that stored it.

In memory (bounded, least recently used ids dropped) or in Redis when the state backend is Redis
(``proxy/state/redis/responses.py``), so that every prefixgate replica finds them.
"""

from __future__ import annotations

from typing import Protocol

from tokenization.lru import LRU

#: Response ids remembered per process when there is no Redis.
DEFAULT_CAPACITY = 200_000


# -- response id -> rank ------------------------------------------------------------------------------
class ResponseRanks(Protocol):
    def get(self, response_id: str) -> str | None:
        """The rank that stored ``response_id``, or None when unknown."""
        ...

    def put(self, response_id: str, rank: str) -> None: ...

    def forget(self, response_id: str) -> None:
        """Drop ``response_id`` (its session ended)."""
        ...


class MemoryResponseRanks(LRU[str, str]):
    """Response id -> rank name, least recently used ids dropped past ``capacity``."""

    __slots__ = ()

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        super().__init__(capacity)

    def forget(self, response_id: str) -> None:
        self.discard(response_id)
