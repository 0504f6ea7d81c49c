"""The one LRU map of prefixgate: bounded by a budget of costs (bytes, or 1 per entry) and a count.

``budget_bytes`` and ``nbytes`` say bytes because most users charge bytes; a cache bounded by entry
count charges 1 per entry.

Every bounded cache in the proxy is one of these: the tokenizers' shared-prefix caches, the
canonicalizer's caches of canonical texts and tools, the response id -> rank map and the owner of
per-session state (``proxy.state.local``).

Invariants, after every call:

- ``nbytes`` is the sum of the costs of the entries held, and ``nbytes <= budget_bytes``;
- ``len(self) <= max_entries`` when a count bound is set;
- entries are ordered by last use (``get`` or ``put``), and eviction takes the least recently used
  first; an entry whose own cost exceeds the whole budget is never kept (it would only flush
  everything else), and putting one drops the key's previous value.

Thread-safe: tokenizer plans may finish in worker threads while the event loop reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """Least-recently-used map: ``put(key, value, cost)`` evicts the oldest entries while the costs
    exceed ``budget_bytes`` (or the entries exceed ``max_entries``). ``on_evict(key, value)`` runs for
    every entry evicted for room (not for ``pop`` or replacement)."""

    __slots__ = (
        "_entries",
        "_lock",
        "budget_bytes",
        "evictions",
        "hits",
        "max_entries",
        "misses",
        "nbytes",
        "on_evict",
    )

    def __init__(
        self,
        budget_bytes: int,
        *,
        max_entries: int | None = None,
        on_evict: Callable[[K, V], None] | None = None,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.max_entries = max_entries
        self.on_evict = on_evict
        self._lock = threading.Lock()
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        """The value for ``key`` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def peek(self, key: K) -> V | None:
        """The value for ``key`` without counting it as a use (for reads that must not change order)."""
        entry = self._entries.get(key)
        return None if entry is None else entry[0]

    def put(self, key: K, value: V, cost: int = 1) -> None:
        """Keep ``value`` (about ``cost`` of the budget) under ``key``, replacing its previous value
        (which is dropped even when the new one is too large to keep)."""
        evicted: list[tuple[K, V]] = []
        with self._lock:
            self._discard(key)
            if cost > self.budget_bytes:
                return
            self._entries[key] = (value, cost)
            self.nbytes += cost
            while self.nbytes > self.budget_bytes or (
                self.max_entries is not None and len(self._entries) > self.max_entries
            ):
                old_key, (old_value, size) = self._entries.popitem(last=False)
                self.nbytes -= size
                self.evictions += 1
                evicted.append((old_key, old_value))
        if self.on_evict is not None:
            for old_key, old_value in evicted:
                self.on_evict(old_key, old_value)

    def recost(self, key: K, cost: int) -> None:
        """Charge ``key``'s entry ``cost`` from now on (it grew or shrank in place)."""
        entry = self._entries.get(key)
        if entry is not None:
            self.put(key, entry[0], cost)

    def pop(self, key: K) -> V | None:
        """Remove ``key``'s entry and return its value (None: not held)."""
        with self._lock:
            old = self._entries.pop(key, None)
            if old is None:
                return None
            self.nbytes -= old[1]
            return old[0]

    def discard(self, key: K) -> None:
        """Forget ``key``'s value, if any."""
        self.pop(key)

    def _discard(self, key: K) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]

    def nbytes_of(self, key: K) -> int | None:
        """The cost charged for ``key``'s value (None: not held); does not count as a use."""
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def __iter__(self) -> Iterator[K]:
        """The keys, least recently used first (from a copy: safe to mutate the map while walking it)."""
        with self._lock:
            held = list(self._entries)
        return iter(held)

    def values(self) -> Iterator[V]:
        """The values, least recently used first (from a copy)."""
        with self._lock:
            held = [value for value, _ in self._entries.values()]
        return iter(held)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.nbytes = 0

    def stats(self) -> dict[str, int]:
        """Entries, cost held, hits, misses and evictions."""
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }
