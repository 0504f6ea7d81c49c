"""The CPU tier of a simulated rank: blocks evicted from the GPU pool, kept in host memory (LRU).

What vLLM's KV offloading (its offloading connector, or LMCache) does, reduced to what a router
sees: a block the GPU pool evicts is copied to CPU memory (``BlockStored``, medium ``CPU``, by hash
alone), unless a copy is there already; past the tier's size its least recently used block goes
(``BlockRemoved``, medium ``CPU``). A prompt whose prefix continues in the tier after its GPU hits
loads those blocks back (at the rank's load rate, instead of prefilling them): they are allocated
and cached in the GPU pool again (``BlockStored``, medium ``GPU``), keep their CPU copy and become
its most recently used; the rank reports them in ``cached_tokens`` with the GPU hits.

Invariants: one copy per hash (the pool keeps a copy per request; the tier de-duplicates);
``len(blocks) <= capacity``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence

from tokenization.block_hash import BlockHash

#: KV events' medium of the tier's blocks, as vLLM's offloading connector names it.
CPU_MEDIUM = "CPU"


class CpuTier:
    """An LRU set of block hashes bounded to ``capacity`` blocks. Not thread-safe (the engine's)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("a CPU tier holds at least one block")
        self.capacity = capacity
        #: hash -> None, least recently used first
        self.blocks: OrderedDict[BlockHash, None] = OrderedDict()
        #: Blocks copied in, evicted, and loaded back to the GPU since start.
        self.stored = 0
        self.evicted = 0
        self.loaded = 0

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __iter__(self) -> Iterator[BlockHash]:
        return iter(self.blocks)

    def hits(self, block_hashes: Iterable[BlockHash]) -> int:
        """How many leading blocks of ``block_hashes`` the tier holds (a read: recency unchanged)."""
        n = 0
        for h in block_hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def offload(self, block_hash: BlockHash) -> tuple[bool, list[BlockHash]]:
        """Copy a block the GPU evicts: (whether it was copied, not held yet; the blocks evicted
        past capacity to make room, least recently used first)."""
        blocks = self.blocks
        if block_hash in blocks:
            return False, []
        blocks[block_hash] = None
        self.stored += 1
        evicted: list[BlockHash] = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        self.evicted += len(evicted)
        return True, evicted

    def load(self, block_hashes: Sequence[BlockHash]) -> None:
        """These blocks are loaded back to the GPU: the most recently used now, head newest."""
        blocks = self.blocks
        for h in reversed(block_hashes):
            blocks.move_to_end(h)
        self.loaded += len(block_hashes)

    def clear(self) -> None:
        self.blocks.clear()


def passed_over_cpu_blocks(
    block_hashes: Sequence[BlockHash],
    max_blocks: int,
    held: int,
    peers: Iterable[tuple[Mapping[BlockHash, object], CpuTier]],
) -> bool:
    """Whether a prompt this rank holds ``held`` leading blocks of was sent away from a peer rank
    holding more of it, part of that in the peer's CPU tier: a session moved off the rank keeping
    its blocks in CPU memory (the benchmark's count, ``SimConfig.cpu_tier_tokens``). Peers are
    other ranks of this process, read from this rank's thread: membership tests only, each atomic
    under the GIL, so a read never sees a dict mid-change nor changes it. Each peer is its GPU pool's
    cached blocks (``BlockPool.cached``) and its CPU tier."""
    for cached, tier in peers:
        offloaded = tier.blocks
        gpu = 0
        while gpu < max_blocks and cached.get(block_hashes[gpu]):
            gpu += 1
        cpu = 0
        while gpu + cpu < max_blocks and block_hashes[gpu + cpu] in offloaded:
            cpu += 1
        if cpu and gpu + cpu > held:
            return True
    return False
