"""vLLM's CPU-offload KV events, made by vLLM's own code at the pinned version, through prefixgate.

The vLLM CPU build this tier runs refuses KV offloading ("CPU Offloading is currently only supported
on CUDA-alike and XPU GPUs", ``vllm/v1/kv_offload/cpu/spec.py``), so no rank here can publish
CPU-tier events. Instead a script run in the tier's vLLM virtualenv (``tests/vllm/install.sh``;
vLLM 0.32.0) makes the events with vLLM's own classes and code, encodes each batch with the encoder
its ZMQ publisher uses, and prefixgate's decoder and in-memory index take the bytes. Where each
event comes from in the installed source:

- GPU stores: ``vllm/v1/core/block_pool.py`` ``BlockPool.cache_full_blocks`` /
  ``_build_block_stored_event``: one ``BlockStored`` per run of newly cached blocks, parent the
  block before the run (None at block 0), the run's token ids, ``medium="GPU"``. GPU evictions:
  ``BlockPool._emit_block_removed_events``: one ``BlockRemoved`` per block, ``medium="GPU"``.
- CPU stores and evictions: the real ``CPUOffloadingManager`` (``vllm/v1/kv_offload/cpu/manager.py``,
  LRU, 3 chunks of one block): ``prepare_store`` queues a removal ``OffloadingEvent`` of what it
  evicts, before the store; ``complete_store`` queues the store. The real ``OffloadingEventsTracker``
  (``vllm/distributed/kv_transfer/kv_connector/v1/offloading/events.py`` ``take_events``, drained by
  ``OffloadingConnectorScheduler.take_events``) turns them into ``BlockStored``/``BlockRemoved`` with
  ``medium="CPU"``. Both of its shapes are checked: the default placeholder
  (``_placeholder_stored``: one event per block, ``token_ids=[]``, ``parent_block_hash=None``,
  ``block_size=0``) and the self-describing one (``self_describing_kv_events``: the chunk's tokens
  and parent, as ``_build_event_metadata`` snapshots them). A load back to the GPU
  (``prepare_load``/``complete_load``) publishes no CPU event, only the GPU pool's store.
- One batch per scheduler step, GPU events first, then the connector's:
  ``vllm/v1/core/sched/scheduler.py`` ``Scheduler.update_from_output`` (``KVEventBatch``); bytes by
  ``msgspec.msgpack.Encoder`` as ``ZmqEventPublisher._publisher_thread`` (``kv_events.py``) makes them.
- A clear: ``BlockPool.reset_prefix_cache`` appends ``AllBlocksCleared()``, which has no ``medium``
  field in 0.32 (a one-tier clear cannot be expressed); the offloading manager's ``reset_cache``
  publishes nothing. prefixgate takes a medium-less clear as every tier cleared.

Cached tokens: ``Scheduler.schedule`` passes ``num_external_computed_tokens`` (the offloading
connector's ``get_num_new_matched_tokens``: the blocks it loads back from CPU) to
``PrefillStats.set`` (``vllm/v1/metrics/stats.py``), which sums them with the local prefix hits into
``num_cached_tokens``; ``OutputProcessor`` (``vllm/v1/engine/output_processor.py``) copies that into
the output, and the OpenAI servers (``entrypoints/openai/chat_completion/serving.py``) report it as
``usage.prompt_tokens_details.cached_tokens``. So CPU-loaded tokens are counted, as prefixgate's
estimate assumes (docs/tiers.md): it counts CPU-only blocks in the total and gives them apart too.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import pytest

from routing.index import CPU, GPU
from routing.index.memory import MemoryPrefixIndex
from routing.kv_events import RankMirror, decode_batch
from routing.ranks import Rank
from tests.vllm.ranks import venv_python
from tokenization.block_hash import BlockHasher

BLOCK = 32
RANK = "r0"

# Runs in the vLLM virtualenv: argv[1] is "placeholder" or "self_describing"; prints JSON with the
# chains' tokens and vLLM's uint64 block hashes, and per step the msgpack payload as hex.
GENERATOR = r"""
import json, sys, time
import msgspec
from vllm.distributed.kv_events import (
    MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.events import (
    OffloadingEventGroupSpec, OffloadingEventsTracker, _OffloadEventMetadata)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash, maybe_convert_block_hash
from vllm.v1.kv_offload.base import Medium, OffloadingKVEventsConfig, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

self_describing = sys.argv[1] == "self_describing"
BLOCK = 32
sha = get_hash_fn_by_name("sha256")
init_none_hash(sha)
chains = {"x": list(range(1000, 1000 + 3 * BLOCK)), "y": list(range(5000, 5000 + BLOCK))}
hashes = {}
for name, toks in chains.items():
    parent, chain = None, []
    for i in range(0, len(toks), BLOCK):
        parent = hash_block_tokens(sha, parent, toks[i:i + BLOCK])
        chain.append(parent)
    hashes[name] = chain
ext = maybe_convert_block_hash
manager = CPUOffloadingManager(num_chunks=3, enable_events=True)
tracker = OffloadingEventsTracker(OffloadingKVEventsConfig(True, self_describing))
ctx = ReqContext(req_id="r")
spec = OffloadingEventGroupSpec("full_attention", None)

def key(h):
    return make_offload_key(h, 0)

def gpu_stored(name, first, last):  # BlockPool.cache_full_blocks / _build_block_stored_event
    hs, toks = hashes[name], chains[name]
    return BlockStored(
        block_hashes=[ext(h) for h in hs[first:last]],
        parent_block_hash=ext(hs[first - 1]) if first else None,
        token_ids=toks[first * BLOCK:last * BLOCK], block_size=BLOCK, lora_id=None,
        medium=MEDIUM_GPU, lora_name=None, extra_keys=[None] * (last - first), group_idx=0,
        session_id=None)

def gpu_removed(h):  # BlockPool._emit_block_removed_events: one event per block
    return BlockRemoved(block_hashes=[ext(h)], medium=MEDIUM_GPU, group_idx=0)

def offload(name, idx):  # the scheduler's _build_store_jobs: record_store, then prepare_store
    keys = [key(hashes[name][i]) for i in idx]
    if self_describing:  # the snapshot OffloadingEventsTracker._build_event_metadata takes
        for i, k in zip(idx, keys):
            tracker._pending_event_metadata[k] = _OffloadEventMetadata(
                block_hashes=(hashes[name][i],),
                parent_block_hash=hashes[name][i - 1] if i else None,
                token_ids=tuple(chains[name][i * BLOCK:(i + 1) * BLOCK]), block_size=BLOCK,
                lora_id=None, lora_name=None, extra_keys=None, group_idx=0, kv_cache_spec=spec,
                active_residencies={(Medium.CPU, None)})
    out = manager.prepare_store(keys, ctx)
    manager.complete_store(keys, ctx)
    return [ext(k[:-4]) for k in out.evicted_keys]

def connector_events():  # OffloadingConnectorScheduler.take_events
    return list(tracker.take_events(manager.take_events()))

encoder = msgspec.msgpack.Encoder()  # ZmqEventPublisher._publisher_thread
steps = []

def publish(step, events, **facts):  # Scheduler.update_from_output: GPU events, then connector's
    batch = KVEventBatch(ts=time.time(), events=events)
    steps.append({"step": step, "payload": encoder.encode(batch).hex(), **facts})

publish("gpu_store", [gpu_stored("x", 0, 3)])
offload("x", [0, 1, 2])
publish("offload", connector_events())
publish("demote_tail", [gpu_removed(h) for h in reversed(hashes["x"][1:])])
tail = [key(h) for h in hashes["x"][1:]]
manager.prepare_load(tail, ctx)
manager.complete_load(tail, ctx)
publish("load_back", [gpu_stored("x", 1, 3)] + connector_events())
publish("demote_all", [gpu_removed(h) for h in reversed(hashes["x"])])
publish("gpu_store_y", [gpu_stored("y", 0, 1)])
evicted = offload("y", [0])
publish("cpu_evict", connector_events(), evicted=evicted)
publish("clear", [AllBlocksCleared()])
print(json.dumps({
    "chains": chains, "hashes": {n: [ext(h) for h in hs] for n, hs in hashes.items()},
    "cleared_fields": list(AllBlocksCleared.__struct_fields__), "steps": steps,
}))
"""


def _vectors(mode: str) -> dict[str, Any]:
    python = venv_python()
    assert python.exists(), f"no vLLM virtualenv at {python}: run tests/vllm/install.sh"
    done = subprocess.run(
        [str(python), "-c", GENERATOR, mode], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    vectors: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return vectors


def _view(index: MemoryPrefixIndex, own: list[bytes]) -> list[str]:
    """Each block's tier in the index: held on the GPU (maybe with a CPU copy), CPU only, or gone."""
    held, cpu_only = set(index.blocks(RANK)), set(index.offloaded_blocks(RANK))
    return ["gone" if h not in held else CPU if h in cpu_only else GPU for h in own]


def _estimate(index: MemoryPrefixIndex, own: list[bytes]) -> tuple[int, int]:
    """(cached tokens, of which CPU only) as routing charges them (``proxy/stages/route.py``)."""
    found = index.lookup(own, None)
    matched = found.matches.get(RANK, 0)
    return matched * BLOCK, found.offloaded_in(RANK, matched) * BLOCK


@pytest.mark.parametrize("mode", ["placeholder", "self_describing"])
def test_vllm_offload_events_keep_the_index_by_tier(mode: str) -> None:
    vectors = _vectors(mode)
    steps = {s["step"]: s for s in vectors["steps"]}
    assert list(steps) == [
        "gpu_store",
        "offload",
        "demote_tail",
        "load_back",
        "demote_all",
        "gpu_store_y",
        "cpu_evict",
        "clear",
    ]
    hasher = BlockHasher(BLOCK, "sha256", seed="0")
    x = hasher.hash_blocks(vectors["chains"]["x"])
    y = hasher.hash_blocks(vectors["chains"]["y"])
    x_u64, y_u64 = vectors["hashes"]["x"], vectors["hashes"]["y"]
    index = MemoryPrefixIndex()
    rank = Rank(RANK, "http://127.0.0.1:1")

    def tier_full(medium: str, tokens: int) -> None:  # as proxy/state/kv_feeds.py hands it over
        if medium == CPU:
            rank.learned_cpu_tier(tokens)

    mirror = RankMirror(RANK, index, hasher, on_tier_full=tier_full)

    def apply(step: str) -> list[Any]:
        _, events, _ = decode_batch(bytes.fromhex(steps[step]["payload"]))
        mirror.apply(events)
        assert mirror.unmapped == 0, f"{step}: every block keyed on prefixgate's chain"
        return events

    apply("gpu_store")
    assert _view(index, x) == [GPU, GPU, GPU]
    assert _estimate(index, x) == (96, 0)

    offloaded = apply("offload")
    assert [(e.type, e.medium) for e in offloaded] == [("BlockStored", CPU)] * 3
    assert [h for e in offloaded for h in e.block_hashes] == x_u64
    if mode == "placeholder":  # hash alone: known from the GPU store
        assert all(e.token_ids == [] and e.parent_block_hash is None and e.block_size == 0 for e in offloaded)
    else:
        assert [e.parent_block_hash for e in offloaded] == [None, *x_u64[:2]]
        assert [t for e in offloaded for t in e.token_ids or []] == vectors["chains"]["x"]
    assert _view(index, x) == [GPU, GPU, GPU]  # on both tiers
    assert mirror.tier_blocks[CPU] == 3
    assert _estimate(index, x) == (96, 0)

    apply("demote_tail")  # GPU removals of blocks with a CPU copy: demotions
    assert _view(index, x) == [GPU, CPU, CPU]
    assert _estimate(index, x) == (96, 64), "CPU-only blocks count in the total and apart"

    apply("load_back")  # stored on the GPU again; the CPU keeps its copies
    assert _view(index, x) == [GPU, GPU, GPU]
    assert mirror.tier_blocks[CPU] == 3
    assert _estimate(index, x) == (96, 0)

    apply("demote_all")
    assert _view(index, x) == [CPU, CPU, CPU]
    assert index.held_by_tier(RANK) == (0, 3)
    assert _estimate(index, x) == (96, 96)

    apply("gpu_store_y")
    assert _view(index, y) == [GPU]
    assert mirror.tier_full_blocks == {} and rank.cpu_tier_tokens is None, "no CPU eviction yet"

    evicting = apply("cpu_evict")  # the full tier (3 blocks) evicts its LRU block to take y's
    evicted = steps["cpu_evict"]["evicted"]
    assert evicted == [x_u64[0]], "x's head: the blocks loaded back were used since"
    assert [(e.type, e.medium, e.block_hashes) for e in evicting] == [
        ("BlockRemoved", CPU, evicted),
        ("BlockStored", CPU, y_u64),
    ]
    assert _view(index, x) == ["gone", CPU, CPU]
    assert _view(index, y) == [GPU]
    assert _estimate(index, x) == (0, 0), "a chain without its head is no prefix hit"
    assert mirror.tier_full_blocks == {CPU: 3}
    assert rank.cpu_tier_tokens == 3 * BLOCK
    assert index.held_by_tier(RANK) == (1, 2)

    assert vectors["cleared_fields"] == [], "vLLM 0.32's AllBlocksCleared names no medium"
    apply("clear")  # a clear with no medium: every tier
    assert _view(index, x + y) == ["gone"] * 4
    assert index.held_by_tier(RANK) == (0, 0)
    assert not +mirror.tier_blocks
