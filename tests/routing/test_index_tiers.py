"""The in-memory index by tier: a block held on the GPU, in CPU memory (vLLM's KV offloading), or both.

A GPU removal while a CPU copy exists is a demotion (still held, CPU only); a CPU eviction is a
removal from CPU; a clear of a medium drops that tier only. Lookups give per rank the matched
prefix (every tier: what vLLM reports as cached) and how many of those blocks have no GPU copy.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from routing.index import CPU, GPU, Lookup
from routing.index.memory import MemoryPrefixIndex
from routing.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, RankMirror, decode_batch
from tests.routing.conftest import chain
from tokenization.block_hash import BlockHasher, kv_event_hash


def tiers(index: MemoryPrefixIndex, hashes: list[bytes]) -> tuple[int, int]:
    """(matched blocks, of which with no GPU copy) on rank ``a``."""
    found = index.lookup(hashes, None)
    assert found.matches == index.match(hashes), "lookup and match agree on the total"
    return found.matches.get("a", 0), found.offloaded.get("a", 0)


def test_gpu_removal_with_a_cpu_copy_is_a_demotion() -> None:
    index = MemoryPrefixIndex()
    blocks = chain("x", 4)
    index.record("a", blocks, counted=True)
    assert tiers(index, blocks) == (4, 0)
    index.record("a", blocks[1:], counted=True, medium=CPU)  # offloaded: on both tiers
    assert tiers(index, blocks) == (4, 0)
    index.remove("a", blocks[2:], counted=True)  # GPU evicts the tail: CPU copies remain
    assert tiers(index, blocks) == (4, 2)
    index.remove("a", blocks[3:], counted=True)  # no GPU copy left to remove: ignored
    assert tiers(index, blocks) == (4, 2)
    index.remove("a", blocks[3:], counted=True, medium=CPU)  # CPU eviction: gone
    assert tiers(index, blocks) == (3, 1)
    index.record("a", blocks[1:3], counted=True)  # loaded back: on the GPU again
    assert tiers(index, blocks) == (3, 0)
    index.remove("a", blocks[:1], counted=True)  # block 0 had no CPU copy: a removal
    assert tiers(index, blocks) == (0, 0)
    assert index.stats()["backends"]["a"]["offloaded_only"] == 0  # type: ignore[index]


def test_a_block_stored_on_cpu_only_is_held_and_offloaded() -> None:
    index = MemoryPrefixIndex()
    blocks = chain("y", 3)
    index.record("a", blocks, counted=True, medium=CPU)
    assert tiers(index, blocks) == (3, 3)
    assert index.stats()["backends"]["a"]["offloaded_only"] == 3  # type: ignore[index]


def test_clear_applies_to_its_medium_only() -> None:
    index = MemoryPrefixIndex()
    both, gpu_only, cpu_only = chain("b", 3), chain("g", 2), chain("c", 2)
    index.record("a", both, counted=True)
    index.record("a", both, counted=True, medium=CPU)
    index.record("a", gpu_only, counted=True)
    index.record("a", cpu_only, counted=True, medium=CPU)
    index.set_session_rank("s", "a")
    index.clear("a", GPU)
    assert (tiers(index, both), tiers(index, gpu_only), tiers(index, cpu_only)) == ((3, 3), (0, 0), (2, 2))
    index.record("a", both, counted=True)
    index.clear("a", CPU)
    assert (tiers(index, both), tiers(index, cpu_only)) == ((3, 0), (0, 0))
    assert index.session_rank("s") == "a", "a tier's clear is no restart"
    index.record("a", cpu_only, counted=True, medium=CPU)
    index.clear("a")  # no medium: every tier
    assert (tiers(index, both), tiers(index, cpu_only)) == ((0, 0), (0, 0))


def test_eviction_past_capacity_leaves_every_tier() -> None:
    index = MemoryPrefixIndex()
    index.set_capacity("a", 4)
    old, new = chain("old", 3), chain("new", 3)
    index.record("a", old, counted=True, medium=CPU)
    index.record("a", new, counted=True)  # 6 > 4: old's tail goes, CPU copies with it
    assert tiers(index, old) == (1, 1)
    index.set_capacity("a", None)
    index.record("a", old[1:], counted=True)  # a GPU store of evicted blocks: no stale CPU copy
    assert tiers(index, old) == (3, 1)


# -- the invariants, against a model: per block, its copies by tier ----------------------------------

_CHAINS = [chain("s", 6), chain("s", 6)[:3] + chain("t", 3, chain("s", 3)[-1]), chain("u", 4)]


@st.composite
def operation(draw: st.DrawFn) -> tuple[str, str | None, int, int, int]:
    kind = draw(st.sampled_from(["store", "store", "remove", "remove", "clear"]))
    medium = draw(st.sampled_from([GPU, CPU, None] if kind == "clear" else [GPU, CPU]))
    c = draw(st.integers(0, len(_CHAINS) - 1))
    lo = draw(st.integers(0, len(_CHAINS[c]) - 1))
    hi = draw(st.integers(lo + 1, len(_CHAINS[c])))
    return kind, medium, c, lo, hi


@settings(max_examples=300, deadline=None)
@given(st.lists(operation(), max_size=40))
def test_tiers_agree_with_a_copy_model(ops: list[tuple[str, str | None, int, int, int]]) -> None:
    """After any events: a block is held iff it has a copy in some tier; a lookup's match is the
    leading held blocks and its offloaded count those of them with no GPU copy; the mirror's own
    invariants hold (every offloaded copy belongs to a held block, GPU copies >= 0)."""
    index = MemoryPrefixIndex()
    model: dict[bytes, dict[str, int]] = {}
    for kind, medium, c, lo, hi in ops:
        blocks = _CHAINS[c][lo:hi]
        if kind == "store":
            assert medium is not None
            index.record("a", blocks, counted=True, medium=medium)
            for h in blocks:
                copies = model.setdefault(h, {GPU: 0, CPU: 0})
                copies[medium] += 1
        elif kind == "remove":
            assert medium is not None
            index.remove("a", blocks, counted=True, medium=medium)
            for h in blocks:
                if h in model and model[h][medium] > 0:
                    model[h][medium] -= 1
        else:
            index.clear("a", medium)
            for copies in model.values():
                for tier in [medium] if medium else [GPU, CPU]:
                    copies[tier] = 0
        model = {h: c for h, c in model.items() if c[GPU] + c[CPU] > 0}
        index._mirror("a").check_tiers()
        for hashes in _CHAINS:
            held = 0
            while held < len(hashes) and hashes[held] in model:
                held += 1
            offloaded = sum(1 for h in hashes[:held] if model[h][GPU] == 0)
            assert tiers(index, hashes) == (held, offloaded)
    mirror = index._mirror("a")
    assert mirror.size == len(model)
    assert all(mirror.copies(h) == c[GPU] + c[CPU] for h, c in model.items())


# -- KV events by tier -------------------------------------------------------------------------------


def test_cpu_events_by_hash_alone_follow_the_gpu_store(shared_dir: Path) -> None:
    """vLLM's offloading connector announces CPU copies by hash (no tokens): mapped through the
    GPU store that named them. The vector's GPU store, then an offload, then the GPU eviction."""
    spec = json.loads((shared_dir / "specs" / "vllm_kv_event_payloads.json").read_text())
    _, events, _ = decode_batch(
        bytes.fromhex(spec["payloads_hex"]["vllm-0.33.0 (events as maps with a type key)"])
    )
    hasher = BlockHasher(16, "sha256", seed="0")
    own = hasher.hash_blocks(list(range(32)))
    u64s = spec["event_block_hashes_u64"]
    index = MemoryPrefixIndex()
    mirror = RankMirror("a", index, hasher)
    mirror.apply(events[:1])  # BlockStored, GPU
    mirror.apply([BlockStored(u64s, None, [], 16, medium=CPU), BlockStored([7], None, [], 16, medium=CPU)])
    assert mirror.unmapped == 1, "a CPU store of a block never seen on the GPU cannot be keyed"
    assert tiers(index, own) == (2, 0)
    mirror.apply(events[1:2])  # BlockRemoved of block 1, GPU: demoted
    assert tiers(index, own) == (2, 1)
    mirror.apply([BlockRemoved([u64s[1]], medium=CPU)])
    assert tiers(index, own) == (1, 0)
    mirror.apply([AllBlocksCleared(medium=GPU)])  # block 0 still on CPU
    assert tiers(index, own) == (1, 1)
    mirror.apply(events[2:])  # AllBlocksCleared without medium: everything
    assert tiers(index, own) == (0, 0)
    assert not mirror._own


def test_cpu_store_with_tokens_is_hashed_like_a_gpu_store() -> None:
    hasher = BlockHasher(16, "sha256", seed="0")
    tokens = list(range(100, 148))
    own = hasher.hash_blocks(tokens)
    u64s = [kv_event_hash(h) for h in own]
    index = MemoryPrefixIndex()
    mirror = RankMirror("a", index, hasher)
    mirror.apply([BlockStored(u64s, None, tokens, 16, medium=CPU)])
    assert tiers(index, own) == (3, 3)
    mirror.apply([BlockRemoved(u64s[2:], medium=GPU)])  # no GPU copy: ignored
    assert tiers(index, own) == (3, 3)


def test_the_estimates_cpu_part_takes_the_blocks_past_it_off_the_offloaded_first() -> None:
    """10 blocks matched, the last 3 CPU-only: an estimate of all 10 has 3 of them, one of 9 (the
    prompt's last block recomputed) 2, one of 7 none."""
    found = Lookup({"a": 10, "b": 4}, None, {"a": 3})
    assert [found.offloaded_in("a", n) for n in (10, 9, 7, 0)] == [3, 2, 0, 0]
    assert found.offloaded_in("b", 4) == 0 and found.offloaded_in("c", 0) == 0


def test_one_removal_naming_a_block_twice_takes_two_of_its_gpu_copies_only() -> None:
    """A block with two GPU copies and one CPU copy, removed from the GPU three times in one call:
    two demote it (the CPU copy is then all it has), the third is ignored; the tier invariants hold."""
    h = chain("d", 1)
    index = MemoryPrefixIndex()
    index.record("a", h, counted=True)
    index.record("a", h, counted=True)
    index.record("a", h, counted=True, medium=CPU)
    assert tiers(index, h) == (1, 0)
    index.remove("a", h * 3, counted=True, medium=GPU)
    index._mirror("a").check_tiers()
    assert tiers(index, h) == (1, 1) and index._mirror("a").copies(h[0]) == 1
    index.remove("a", h, counted=True, medium=CPU)
    assert tiers(index, h) == (0, 0)


class CountingHasher(BlockHasher):
    """Counts the blocks it hashes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hashed = 0

    def hash_blocks(self, tokens: Sequence[int], **kwargs: Any) -> list[bytes]:
        out = super().hash_blocks(tokens, **kwargs)
        self.hashed += len(out)
        return out


def test_a_gpu_store_of_blocks_the_mirror_maps_reuses_their_hashes() -> None:
    """Behind a CPU tier a rank stores again, on the GPU, blocks it loads back from CPU memory: those
    the mirror maps keep their own hashes (not hashed again from their tokens); the blocks after them
    are hashed from the last of them, and key the same as a prompt hashed whole."""
    hasher = CountingHasher(16, "sha256", seed="0")
    tokens = list(range(100, 180))  # 5 blocks
    own = BlockHasher(16, "sha256", seed="0").hash_blocks(tokens)
    u64s = [kv_event_hash(h) for h in own]
    index = MemoryPrefixIndex()
    mirror = RankMirror("a", index, hasher)
    mirror.apply([BlockStored(u64s[:3], None, tokens[:48], 16)])
    mirror.apply([BlockStored(u64s[:3], None, [], 16, medium=CPU), BlockRemoved(u64s[:3])])  # demoted
    assert tiers(index, own[:3]) == (3, 3)
    hasher.hashed = 0
    mirror.apply([BlockStored(u64s, None, tokens, 16)])  # loaded back, and two new blocks after them
    assert hasher.hashed == 2
    assert tiers(index, own) == (5, 0) and mirror.unmapped == 0
    index._mirror("a").check_tiers()
