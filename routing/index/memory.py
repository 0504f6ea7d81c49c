"""The in-memory prefix index: each rank's mirror as chain segments, bounded by the rank's pool.

Each rank's mirror (``routing.index.chains.RankChains``) keeps its blocks as runs of consecutive
blocks of the chains that recorded them, with exact recency: the same order as one LRU list per
rank whose ``record`` touches a request's blocks tail first (vLLM's free queue: the head of a chain
is the most recent and, past capacity, the tail of the least recently used chain goes first). A
lookup or a record walks a prompt run by run, so a returning session costs a few compares for the
prefix it shares with what a rank holds (its agent's head, its own previous turns) plus its new
tail, whatever its length; a first turn costs its new blocks.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from routing.index import GPU, Lookup
from routing.index.chains import RankChains
from tokenization.lru import LRU

#: Sessions remembered per process; the oldest is forgotten past this.
DEFAULT_MAX_SESSIONS = 100_000


class MemoryPrefixIndex:
    """``PrefixIndex`` in one process. Thread-safe (the KV-event subscriber writes from its thread)."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self._lock = threading.Lock()
        self._mirrors: dict[str, RankChains] = {}
        self._sessions: LRU[str, str] = LRU(max_sessions)

    # -- configuration ---------------------------------------------------------------------------

    def _mirror(self, rank: str) -> RankChains:
        mirror = self._mirrors.get(rank)
        if mirror is None:
            mirror = self._mirrors[rank] = RankChains()
        return mirror

    def set_capacity(self, rank: str, blocks: int | None) -> None:
        with self._lock:
            self._mirror(rank).set_capacity(blocks)

    @property
    def ranks(self) -> list[str]:
        return list(self._mirrors)

    # -- lookups ---------------------------------------------------------------------------------

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` each rank holds (ranks holding none left out)."""
        held: dict[str, int] = {}
        if not block_hashes:
            return held
        first = block_hashes[0]
        with self._lock:
            for name, mirror in self._mirrors.items():
                if first in mirror:
                    held[name] = mirror.held_prefix(block_hashes)
        return held

    def held_prefix(self, rank: str, block_hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``block_hashes`` that ``rank`` holds (``match`` for one rank)."""
        with self._lock:
            mirror = self._mirrors.get(rank)
            return 0 if mirror is None or not block_hashes else mirror.held_prefix(block_hashes)

    def walk_match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """``match`` testing the blocks one by one: the reference the run-by-run walk must agree with."""
        held: dict[str, int] = {}
        with self._lock:
            for name, mirror in self._mirrors.items():
                n = 0
                for h in block_hashes:
                    if h not in mirror:
                        break
                    n += 1
                if n:
                    held[name] = n
        return held

    def lookup(self, block_hashes: Sequence[bytes], session_key: str | None) -> Lookup:
        matches, offloaded = self.match_tiers(block_hashes)
        return Lookup(matches, self.session_rank(session_key) if session_key else None, offloaded)

    def match_tiers(self, block_hashes: Sequence[bytes]) -> tuple[dict[str, int], dict[str, int]]:
        """``match``, and per rank how many of the matched blocks have no GPU copy (ranks with
        none left out): a rank's GPU blocks are its match minus those."""
        held: dict[str, int] = {}
        offloaded: dict[str, int] = {}
        if not block_hashes:
            return held, offloaded
        first = block_hashes[0]
        with self._lock:
            for name, mirror in self._mirrors.items():
                if first in mirror:
                    n = held[name] = mirror.held_prefix(block_hashes)
                    off = mirror.offloaded_only(block_hashes, n)
                    if off:
                        offloaded[name] = off
        return held, offloaded

    def session_rank(self, session_key: str) -> str | None:
        return self._sessions.get(session_key)

    def set_session_rank(self, session_key: str, rank: str) -> None:
        self._sessions.put(session_key, rank)

    def bind_session(self, session_key: str, rank: str, previous: str | None) -> str:
        # one process, one event loop: nobody else can have bound it since the lookup
        self._sessions.put(session_key, rank)
        return rank

    def forget_session(self, session_key: str) -> None:
        self._sessions.discard(session_key)

    def sessions(self) -> list[tuple[str, str]]:
        """Every remembered (session, rank), least recently used first (for resynchronization)."""
        sessions = self._sessions
        return [(key, rank) for key in sessions if (rank := sessions.peek(key)) is not None]

    # -- updates ---------------------------------------------------------------------------------

    def record(
        self, rank: str, block_hashes: Sequence[bytes], *, counted: bool = False, medium: str = GPU
    ) -> None:
        """Touch ``block_hashes`` (one chain, distinct hashes) on ``rank``: tail first, so that the
        head ends up the most recently used, then evict past capacity.

        Invariant: afterwards the chain's blocks are the most recent entries, in reverse chain order
        (head newest), and the other entries keep their relative order; so eviction, least recently
        used first, takes a chain's tail before its head.

        ``counted`` with a ``medium`` other than GPU (an offload: consecutive blocks of a chain):
        one more copy of each in that tier; blocks already held keep their recency.
        """
        with self._lock:
            if counted and medium != GPU:
                self._mirror(rank).record_offloaded(block_hashes, medium)
            else:
                self._mirror(rank).record(block_hashes, counted)

    def remove(
        self, rank: str, block_hashes: Sequence[bytes], *, counted: bool = False, medium: str = GPU
    ) -> None:
        with self._lock:
            mirror = self._mirrors.get(rank)
            if mirror is None:
                return
            if counted:
                mirror.remove_copies(block_hashes, medium)
            else:
                mirror.remove(block_hashes)

    def clear(self, rank: str, medium: str | None = None) -> None:
        with self._lock:
            mirror = self._mirrors.get(rank)
            if mirror is None:
                return
            if medium is not None:  # one tier emptied: the rank did not restart
                mirror.clear_tier(medium)
                return
            mirror.clear()
            for key in [k for k in self._sessions if self._sessions.peek(k) == rank]:
                self._sessions.discard(key)

    def held_by_tier(self, rank: str) -> tuple[int, int]:
        with self._lock:
            mirror = self._mirrors.get(rank)
            if mirror is None:
                return 0, 0
            offloaded = mirror.offloaded_only_count()
            return mirror.size - offloaded, offloaded

    def offloaded_among(self, rank: str, block_hashes: Sequence[bytes]) -> set[bytes]:
        """Those of ``block_hashes`` that ``rank`` holds in CPU memory only (no GPU copy)."""
        with self._lock:
            mirror = self._mirrors.get(rank)
            if mirror is None or not mirror.off_gpu:
                return set()
            return mirror.off_gpu.intersection(block_hashes)

    def offloaded_blocks(self, rank: str) -> list[bytes]:
        """Every block ``rank`` holds in CPU memory only (a snapshot)."""
        with self._lock:
            mirror = self._mirrors.get(rank)
            return [] if mirror is None else list(mirror.off_gpu)

    def blocks(self, rank: str) -> list[bytes]:
        """``rank``'s mirrored hashes, least recently used first."""
        with self._lock:
            mirror = self._mirrors.get(rank)
            return [] if mirror is None else mirror.order()

    def missing(self, rank: str, block_hashes: Sequence[bytes]) -> list[bytes]:
        """Those of ``block_hashes`` that ``rank``'s mirror does not hold."""
        with self._lock:
            mirror = self._mirrors.get(rank)
            if mirror is None:
                return list(block_hashes)
            return [h for h in block_hashes if h not in mirror]

    def event_writer_of(self) -> frozenset[str] | None:
        return None

    def stats(self) -> dict[str, object]:
        with self._lock:
            mirrors = list(self._mirrors.values())
            distinct = (
                len(mirrors[0].where) if len(mirrors) == 1 else len(set().union(*(m.where for m in mirrors)))
            )
            return {
                "store": "memory",
                "distinct_blocks": distinct,
                "sessions": len(self._sessions),
                "backends": {
                    name: {
                        "blocks": m.size,
                        "segments": len(m.segments),
                        "capacity": m.capacity,
                        "evicted": m.evicted,
                        "offloaded_only": m.offloaded_only_count(),
                    }
                    for name, m in self._mirrors.items()
                },
            }
