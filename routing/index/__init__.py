"""The prefix index: which leading blocks of a prompt each rank probably holds.

One interface (``PrefixIndex``) and two stores: ``memory.MemoryPrefixIndex`` (the default, one
process) and the state backend's Redis index (``proxy/state/redis/index.py``: shared by every
prefixgate replica, with the memory store as its local mirror and fallback; the backend builds it
and hands it over, so nothing here imports it). Block hashes are vLLM's chained hashes, so "block i is
held" implies the whole prefix up to i is identical; a match walks from block 0 and stops at the
first block a rank does not hold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

#: vLLM's default storage medium (KV events' ``medium``): the rank's GPU pool.
GPU = "GPU"
#: The medium of blocks vLLM's offloading connector (or LMCache) keeps in host memory.
CPU = "CPU"


@dataclass(slots=True)
class Lookup:
    """One lookup: leading blocks held per rank name (every tier), and the session's remembered rank.

    ``offloaded``: per rank, how many of its matched blocks have no GPU copy (held in CPU memory by
    vLLM's KV offloading; a rank with none is left out). vLLM reports them among the cached tokens
    when it loads them back, so ``matches`` counts them too.
    """

    matches: dict[str, int] = field(default_factory=dict)
    session_rank: str | None = None
    offloaded: dict[str, int] = field(default_factory=dict)

    def offloaded_in(self, rank: str, blocks: int) -> int:
        """Of ``rank``'s first ``blocks`` matched blocks, those with no GPU copy. The GPU evicts a
        chain's tail first and vLLM looks up its GPU blocks before its CPU ones, so the offloaded
        blocks are the match's last: the blocks past ``blocks`` are taken off them first."""
        return offloaded_within(self.matches.get(rank, 0), self.offloaded.get(rank, 0), blocks)


def offloaded_within(matched: int, offloaded: int, blocks: int) -> int:
    """Of a rank's first ``blocks`` matched blocks, those with no GPU copy, when ``offloaded`` of
    its ``matched`` blocks have none (they are the match's last: ``Lookup.offloaded_in``)."""
    return max(0, min(offloaded - (matched - blocks), blocks))


class PrefixIndex(Protocol):
    """What routing needs from a mirror of the ranks' prefix caches.

    ``counted`` operations keep a reference count per (rank, hash): KV-cache events report every
    physical copy of a block (vLLM does not de-duplicate concurrent requests' blocks), so a hash
    leaves the mirror only when its last copy is removed. Uncounted operations (routing's own
    predictions) add or drop a hash outright.

    ``medium`` is the storage tier a counted operation is about (KV events' ``medium``: ``GPU``, or
    ``CPU`` for blocks offloaded to host memory). A block is held while some copy is held in some
    tier: a GPU removal of a block with a CPU copy demotes it (``routing.index.memory``'s docstring).
    """

    def set_capacity(self, rank: str, blocks: int | None) -> None:
        """Bound ``rank``'s mirror to ``blocks`` (None: unbounded, e.g. driven by KV events)."""
        ...

    def match(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` held, for every rank holding at least block 0."""
        ...

    def lookup(self, block_hashes: Sequence[bytes], session_key: str | None) -> Lookup:
        """``match`` plus the session's remembered rank, in one store access."""
        ...

    def record(
        self, rank: str, block_hashes: Sequence[bytes], *, counted: bool = False, medium: str = GPU
    ) -> None:
        """``rank`` holds these blocks now (most recently used: head, then towards the tail);
        ``counted`` with another ``medium`` than GPU: one more copy of each in that tier."""
        ...

    def remove(
        self, rank: str, block_hashes: Sequence[bytes], *, counted: bool = False, medium: str = GPU
    ) -> None:
        """``rank`` no longer holds these blocks (counted: one copy fewer of each, in ``medium``)."""
        ...

    def clear(self, rank: str, medium: str | None = None) -> None:
        """``rank`` holds nothing (cache reset, restart); with ``medium``: nothing in that tier."""
        ...

    def held_by_tier(self, rank: str) -> tuple[int, int]:
        """``rank``'s mirrored blocks: (with a GPU copy, in CPU memory only)."""
        ...

    def set_session_rank(self, session_key: str, rank: str) -> None:
        """Remember the rank a session was sent to (unconditionally: its rank failed it, or a
        resynchronization)."""
        ...

    def bind_session(self, session_key: str, rank: str, previous: str | None) -> str:
        """Bind the session to ``rank`` unless another replica bound it elsewhere since this one's
        lookup saw ``previous`` (None: unbound): the first writer wins, atomically. Returns the rank
        the session is bound to now (``rank``, or the winner's, which the caller adopts)."""
        ...

    def forget_session(self, session_key: str) -> None:
        """Forget the session's rank (the session ended)."""
        ...

    def event_writer_of(self) -> frozenset[str] | None:
        """The event-fed ranks whose mirror this replica writes to the shared index now (it holds
        their lease); None: the index is not shared, every replica keeps its own."""
        ...

    def stats(self) -> dict[str, object]:
        """Sizes and counters, for ``/metrics``-style inspection and tests."""
        ...
