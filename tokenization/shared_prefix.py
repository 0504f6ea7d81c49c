"""A cross-session cache for the leading prompt segment many sessions share (system prompt + tools).

Every session of one agent starts with the same system prompt and tool list, so a new session's
first turn would otherwise re-render, re-tokenize and re-hash that segment (~2k tokens, ~125
blocks) although another session did the same a moment ago. Two such caches exist per backend
group: the tokenizer's (segment input key -> the segment's token ids) and the incremental
tokenizer's (leading tokens + salt -> their full blocks' hashes, which chain from NONE_HASH and are
therefore identical for every session with the same salt and hash algorithm).

Values are immutable and shared: callers copy before extending them.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")

#: Default budget of each shared-prefix cache.
DEFAULT_SHARED_CACHE_BYTES = 32 * 1024 * 1024


class SharedPrefixCache(Generic[V]):
    """LRU by bytes: ``put`` evicts the least recently used entries while over ``budget_bytes``.

    An entry larger than the whole budget is not kept (it would only flush everything else).
    Thread-safe: plans may finish in worker threads while the event loop reads. ``nbytes`` is any
    additive cost: a cache bounded by entry count charges 1 per entry.
    """

    def __init__(self, budget_bytes: int = DEFAULT_SHARED_CACHE_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self.nbytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable) -> V | None:
        """The value for ``key`` (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def put(self, key: Hashable, value: V, nbytes: int) -> None:
        """Keep ``value`` (about ``nbytes`` of memory) under ``key``, replacing its previous value
        (which is dropped even when the new one is too large to keep)."""
        with self._lock:
            self._discard(key)
            if nbytes > self.budget_bytes:
                return
            self._entries[key] = (value, nbytes)
            self.nbytes += nbytes
            while self.nbytes > self.budget_bytes:
                _, (_, size) = self._entries.popitem(last=False)
                self.nbytes -= size
                self.evictions += 1

    def discard(self, key: Hashable) -> None:
        """Forget ``key``'s value, if any."""
        with self._lock:
            self._discard(key)

    def _discard(self, key: Hashable) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.nbytes -= old[1]

    def nbytes_of(self, key: Hashable) -> int | None:
        """The bytes charged for ``key``'s value (None: not held); does not count as a use."""
        entry = self._entries.get(key)
        return None if entry is None else entry[1]

    def stats(self) -> dict[str, int]:
        """Entries, bytes held, hits, misses and evictions."""
        return {
            "entries": len(self._entries),
            "bytes": self.nbytes,
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
        }
