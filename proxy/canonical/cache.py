"""A small bounded LRU map: the rule sets' caches of canonical texts and tools, per-session canon state,
response id -> rank (``proxy/responses.py``)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")


class LRU(Generic[K, V]):
    """Least-recently-used map holding at most ``capacity`` entries. Not thread-safe (one event loop)."""

    __slots__ = ("_data", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._data: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        """The value for ``key`` (marking it recently used), or None."""
        value = self._data.get(key)
        if value is not None:
            self._data.move_to_end(key)
        return value

    def put(self, key: K, value: V) -> None:
        """Store ``value``, evicting the least recently used entry when full."""
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)
