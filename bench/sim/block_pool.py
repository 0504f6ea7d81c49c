"""The KV block pool of a simulated rank, with vLLM v1's prefix-caching semantics.

State (vLLM ``v1/core/block_pool.py``):
- ``blocks``: ``num_blocks`` blocks; block 0 is the reserved null block, never allocated or freed.
- ``free queue``: the blocks with ``ref_cnt == 0``, in eviction order (head = evicted first). New
  blocks are taken from the head; freed blocks are appended at the tail, so a block freed earlier is
  evicted earlier (LRU by time of release).
- ``cached``: ``block_hash -> {block_id: block}`` for every block that holds a full, hashed block.
  A cached block can be held (``ref_cnt > 0``) or free (then it stays hittable until the free queue
  hands it out again, which evicts it). Identical blocks are NOT de-duplicated: two requests that
  compute the same block each own a copy, both registered under the hash.

Invariants (checked by :meth:`BlockPool.check_invariants`):
1. a non-null block is in the free queue iff its ``ref_cnt == 0``;
2. a block has a hash iff it is registered in ``cached`` under that hash;
3. ``num_free + sum(held) == num_blocks - 1`` (the null block is never free).

With a CPU tier (``bench.sim.cpu_tier``), an evicted block is offloaded to it first: the events then
say ``BlockStored`` (CPU, when the tier had no copy), the tier's own evictions (``BlockRemoved``,
CPU), then ``BlockRemoved`` (GPU), the order that keeps a subscriber able to key the CPU copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from bench.sim.cpu_tier import CPU_MEDIUM, CpuTier
from tokenization.block_hash import BlockHash

#: KV events' medium of the pool's own blocks (vLLM's default).
GPU_MEDIUM = "GPU"


class Block:
    """One KV block: its id, how many requests hold it, and the hash of the full block it holds."""

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"Block({self.block_id}, ref={self.ref_cnt}, hash={h})"


@dataclass(slots=True)
class BlockStored:
    """Blocks newly registered in the cache (one event per caching call, like vLLM)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    medium: str = GPU_MEDIUM


@dataclass(slots=True)
class BlockRemoved:
    """One cached block evicted (reallocated)."""

    block_hashes: list[BlockHash]
    medium: str = GPU_MEDIUM


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was reset (``medium`` None: every tier, as vLLM sends it)."""

    medium: str | None = None


PoolEvent = BlockStored | BlockRemoved | AllBlocksCleared


class BlockPool:
    """Allocation, release, caching and eviction of KV blocks. Not thread-safe: one engine loop owns it."""

    def __init__(
        self, num_blocks: int, block_size: int, record_events: bool = False, cpu_tier: CpuTier | None = None
    ) -> None:
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2 (block 0 is the null block)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Block 0 is vLLM's null block (a placeholder for skipped blocks): never in the queue.
        self.null_block = self.blocks[0]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks[1:])
        self.cached: dict[BlockHash, dict[int, Block]] = {}
        self.record_events = record_events
        #: Where evicted blocks are offloaded (None: they are gone).
        self.cpu_tier = cpu_tier
        self.events: list[PoolEvent] = []
        #: Cached blocks evicted by reallocation since start (each copy counts).
        self.num_evictions = 0

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be handed out (free, whether or not they still hold a cached block)."""
        return len(self._free)

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - 1

    def usage(self) -> float:
        """Fraction of usable blocks held by requests: ``vllm:kv_cache_usage_perc``."""
        return 1.0 - self.num_free / self.usable_blocks

    def get_cached(self, block_hash: BlockHash) -> Block | None:
        """The first cached block holding ``block_hash`` (held or free), or None."""
        copies = self.cached.get(block_hash)
        if not copies:
            return None
        return next(iter(copies.values()))

    def free_queue_ids(self) -> list[int]:
        """Block ids of the free queue, head (next evicted) first. For tests and debugging."""
        return list(self._free)

    def num_cached_blocks(self) -> int:
        return sum(len(c) for c in self.cached.values())

    # -- mutations -----------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[Block]:
        """Take ``n`` blocks from the head of the free queue, evicting the cached ones among them."""
        if n > len(self._free):
            raise ValueError(f"cannot get {n} free blocks, {len(self._free)} left")
        out: list[Block] = []
        popitem = self._free.popitem
        for _ in range(n):
            _, block = popitem(last=False)
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: Block) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        copies = self.cached[block_hash]
        del copies[block.block_id]
        if not copies:
            del self.cached[block_hash]
        block.block_hash = None
        self.num_evictions += 1
        if self.cpu_tier is not None:
            copied, dropped = self.cpu_tier.offload(block_hash)
            if self.record_events:
                if copied:
                    self.events.append(BlockStored([block_hash], None, [], self.block_size, CPU_MEDIUM))
                self.events.extend(BlockRemoved([h], CPU_MEDIUM) for h in dropped)
        if self.record_events:
            self.events.append(BlockRemoved([block_hash]))

    def touch(self, blocks: Iterable[Block]) -> None:
        """A request hits ``blocks``: take the free ones out of the queue and count the new holder."""
        free = self._free
        for block in blocks:
            if block.ref_cnt == 0:
                del free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[Block]) -> None:
        """Release blocks; those no longer held join the queue tail in the given order."""
        free = self._free
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: Sequence[Block],
        block_hashes: Sequence[BlockHash],
        num_cached: int,
        num_full: int,
        all_token_ids: Sequence[int],
    ) -> None:
        """Register blocks ``num_cached..num_full-1`` of a request under their hashes.

        ``blocks`` and ``block_hashes`` are the request's; the blocks must not hold a hash yet.
        """
        if num_full <= num_cached:
            return
        cached = self.cached
        for i in range(num_cached, num_full):
            block = blocks[i]
            h = block_hashes[i]
            block.block_hash = h
            copies = cached.get(h)
            if copies is None:
                cached[h] = {block.block_id: block}
            else:
                copies[block.block_id] = block
        if self.record_events:
            size = self.block_size
            self.events.append(
                BlockStored(
                    block_hashes=list(block_hashes[num_cached:num_full]),
                    parent_block_hash=block_hashes[num_cached - 1] if num_cached else None,
                    token_ids=list(all_token_ids[num_cached * size : num_full * size]),
                    block_size=size,
                )
            )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any request holds blocks, as in vLLM."""
        if len(self._free) != self.usable_blocks:
            return False
        for copies in self.cached.values():
            for block in copies.values():
                block.block_hash = None
        self.cached.clear()
        if self.cpu_tier is not None:
            self.cpu_tier.clear()
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[PoolEvent]:
        events, self.events = self.events, []
        return events

    def check_invariants(self) -> None:
        """Raise AssertionError when the pool's state breaks an invariant of the module docstring."""
        assert self.null_block.block_id not in self._free, "null block in the free queue"
        for block in self.blocks[1:]:
            in_queue = block.block_id in self._free
            assert in_queue == (block.ref_cnt == 0), f"{block}: queued={in_queue}"
            assert block.ref_cnt >= 0, f"{block}: negative ref count"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash, {}).get(block.block_id) is block, (
                    f"{block} not cached"
                )
        for h, copies in self.cached.items():
            assert copies, "empty hash entry"
            for block in copies.values():
                assert block.block_hash == h, f"{block} registered under another hash"
        held = sum(1 for b in self.blocks[1:] if b.ref_cnt > 0)
        assert held + self.num_free == self.usable_blocks
