"""KV-cache events drive a rank's mirror exactly: vLLM's payload bytes, and a simulated rank."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from bench.sim import PromptProcessor, SimRankServer
from proxy.stages.route import Router
from routing.index.memory import MemoryPrefixIndex
from routing.kv_events import (
    BlockRemoved,
    BlockStored,
    KVEventSubscriber,
    RankMirror,
    decode_batch,
    decode_event,
)
from routing.policies import make_policy
from routing.ranks import Fleet, Rank
from tests.helpers.ranks import RankServers
from tests.helpers.wait import wait_until
from tests.routing.conftest import make_ctx, observe, pick
from tokenization.block_hash import BlockHasher, kv_event_hash


@pytest.mark.parametrize(
    "version", ["vllm-0.11.0 (events as positional arrays)", "vllm-0.33.0 (events as maps with a type key)"]
)
def test_shared_payload_bytes_drive_the_mirror(shared_dir: Path, version: str) -> None:
    spec = json.loads((shared_dir / "specs" / "vllm_kv_event_payloads.json").read_text())
    ts, events, dp_rank = decode_batch(bytes.fromhex(spec["payloads_hex"][version]))
    assert ts == 1700000000.5 and dp_rank == 0
    assert [e.type for e in events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert events[0].block_hashes == spec["event_block_hashes_u64"]
    assert events[0].token_ids == list(range(32)) and events[0].parent_block_hash is None

    # prefixgate hashes with its own chain (sha256, seed "0"): the same blocks the rank announced.
    hasher = BlockHasher(16, "sha256", seed="0")
    own = hasher.hash_blocks(list(range(32)))
    assert [kv_event_hash(h) for h in own] == spec["event_block_hashes_u64"]
    index = MemoryPrefixIndex()
    mirror = RankMirror("r0", index, hasher)
    mirror.apply(events[:1])
    assert index.match(own) == {"r0": 2}
    mirror.apply(events[1:2])
    assert index.match(own) == {"r0": 1}
    mirror.apply(events[2:])
    assert index.match(own) == {}


def test_rank_with_another_hash_seed_is_mapped_onto_our_chain(shared_dir: Path) -> None:
    spec = json.loads((shared_dir / "specs" / "vllm_kv_event_payloads.json").read_text())
    _, events, _ = decode_batch(
        bytes.fromhex(spec["payloads_hex"]["vllm-0.33.0 (events as maps with a type key)"])
    )
    hasher = BlockHasher(16, "sha256", seed="prefixgate")  # not the rank's seed: only the tokens tie them
    own = hasher.hash_blocks(list(range(32)))
    index = MemoryPrefixIndex()
    RankMirror("r0", index, hasher).apply(events[:2])
    assert index.match(own) == {"r0": 1}


@pytest.fixture(params=["0.33", "0.11"])
def sim_rank(request: pytest.FixtureRequest, rank_servers: RankServers) -> SimRankServer:
    (rank,) = rank_servers.sim(  # named sim-0
        1, kv_tokens=64 * 16, kv_events=True, kv_events_version=request.param, hash_seed="0"
    )
    return rank


def wait_applied(sub: KVEventSubscriber, rank: SimRankServer, deadline_s: float = 5.0) -> None:
    """Until the subscriber has applied every batch the rank published."""
    published = -1

    def applied() -> bool:
        nonlocal published
        published = rank.call(lambda r: r.publisher.next_seq) - 1  # type: ignore[union-attr]
        return sub.last_seq >= published

    wait_until(
        applied,
        lambda: f"subscriber stuck at {sub.last_seq}, rank at {published}",
        deadline_s,
        interval=0.005,
    )


def test_sim_events_make_predictions_exact(sim_rank: SimRankServer) -> None:
    """Turn after turn, with the pool too small for all sessions, predicted == reported cached tokens."""
    hasher = BlockHasher(16, "sha256", seed="0")
    prompts = PromptProcessor(hasher)
    backend = Rank("sim-0", sim_rank.url, pool_tokens=64 * 16, block_size=16)
    index = MemoryPrefixIndex()
    router = Router(Fleet([backend]), make_policy("prefix_affinity"), index, exact=["sim-0"])
    # Join late: the first request's events are published before the subscriber exists (replayed).
    client = httpx.Client(base_url=sim_rank.url, timeout=10)
    first = [{"role": "system", "content": "warm-up " * 40}, {"role": "user", "content": "hello"}]
    client.post("/v1/chat/completions", json={"model": "prefixgate-sim", "messages": first, "max_tokens": 2})
    sources = client.get("/kv_event_sources").json()[0]
    kinds: list[str] = []
    sub = KVEventSubscriber(
        RankMirror("sim-0", index, hasher, on_applied=kinds.extend, on_stored=router.inflight_blocks.confirm),
        sources["endpoint"],
        sources["replay_endpoint"],
    ).start()
    try:
        time.sleep(0.05)  # a SUB only receives once its subscription reached the publisher
        conversations = {
            s: [{"role": "system", "content": f"You are agent {s}. " + "Rules follow. " * 30}] for s in "abc"
        }
        compared = 0
        for turn in range(5):
            for s, messages in conversations.items():
                messages.append(
                    {"role": "user", "content": f"turn {turn} of {s}: " + "details " * (20 + 7 * turn)}
                )
                wait_applied(sub, sim_rank)
                prompt = prompts.chat(messages)
                ctx = make_ctx(s, list(prompt.block_hashes), len(prompt.token_ids))
                pick(router, ctx)
                body = {"model": "prefixgate-sim", "messages": messages, "max_tokens": 4}
                answer = client.post("/v1/chat/completions", json=body).json()
                reported = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert answer["usage"]["prompt_tokens"] == len(prompt.token_ids)
                assert ctx.estimated_cached_tokens == reported, f"turn {turn} session {s}"
                observe(router, ctx, backend, reported)
                messages.append(answer["choices"][0]["message"])
                compared += 1
        assert sub.replayed >= 1, "the late start was recovered by replay"
        assert compared == 15
        assert "BlockRemoved" in kinds, "the pool was small enough that the rank evicted blocks"
    finally:
        sub.stop()
        client.close()


class CountingIndex(MemoryPrefixIndex):
    """A memory index that counts the removals it is asked for (a shared index writes one each)."""

    def __init__(self) -> None:
        super().__init__()
        self.removals: list[int] = []

    def remove(
        self, rank: str, block_hashes: Sequence[bytes], *, counted: bool = False, medium: str = "GPU"
    ) -> None:
        self.removals.append(len(block_hashes))
        super().remove(rank, block_hashes, counted=counted, medium=medium)


def test_a_run_of_block_removed_events_is_one_removal_and_the_same_mirror() -> None:
    """vLLM sends one BlockRemoved per evicted block: a run of them in a batch reaches the index as
    one removal (one Redis write for a shared index, not one per block), and the mirror ends as
    applying the events one by one leaves it; a store between two runs splits them."""
    hasher = BlockHasher(16, "sha256", seed="0")
    chains = {name: [base + n for n in range(16 * 4)] for name, base in (("a", 1000), ("b", 5000))}
    ids = {name: [kv_event_hash(h) for h in hasher.hash_blocks(tokens)] for name, tokens in chains.items()}
    events = [
        BlockStored(ids["a"], None, chains["a"], 16),
        *(BlockRemoved([u64]) for u64 in reversed(ids["a"][2:])),  # a's tail, one by one
        BlockStored(ids["b"], None, chains["b"], 16),
        *(BlockRemoved([u64]) for u64 in reversed(ids["b"][1:])),
        BlockRemoved([ids["a"][1]]),
    ]
    batched, one_by_one = CountingIndex(), CountingIndex()
    RankMirror("r0", batched, hasher).apply(events)
    single = RankMirror("r0", one_by_one, hasher)
    for event in events:
        single.apply([event])
    assert batched.removals == [2, 4]  # a's two tail blocks; then b's three and a's second
    assert one_by_one.removals == [1] * 6
    for name in "ab":
        blocks = hasher.hash_blocks(chains[name])
        assert batched.lookup(blocks, None).matches == one_by_one.lookup(blocks, None).matches == {"r0": 1}


_VERSIONS = ["vllm-0.11.0 (events as positional arrays)", "vllm-0.33.0 (events as maps with a type key)"]
_GPU_STR, _CPU_STR = "a3" + b"GPU".hex(), "a3" + b"CPU".hex()  # msgpack fixstr of 3 bytes


@pytest.mark.parametrize("version", _VERSIONS)
@pytest.mark.parametrize("position", [0, 1])
def test_shared_payload_medium_is_kept(shared_dir: Path, version: str, position: int) -> None:
    """vLLM's own classes put ``medium: "GPU"`` on BlockStored and BlockRemoved, none on the clear."""
    spec = json.loads((shared_dir / "specs" / "vllm_kv_event_payloads.json").read_text())
    payload = bytes.fromhex(spec["payloads_hex"][version])
    assert payload.hex().count(_GPU_STR) == 2  # one per stored / removed event
    _, events, _ = decode_batch(payload)
    assert events[position].type == ("BlockStored", "BlockRemoved")[position]
    assert events[position].medium == "GPU"
    assert events[2].type == "AllBlocksCleared" and events[2].medium is None  # every tier


@pytest.mark.parametrize("version", _VERSIONS)
def test_cpu_medium_of_the_same_bytes_is_kept(shared_dir: Path, version: str) -> None:
    """The vectors with "GPU" replaced by "CPU" (same encoding, same length): offloaded blocks."""
    spec = json.loads((shared_dir / "specs" / "vllm_kv_event_payloads.json").read_text())
    payload = bytes.fromhex(spec["payloads_hex"][version].replace(_GPU_STR, _CPU_STR))
    _, events, _ = decode_batch(payload)
    assert [e.medium for e in events] == ["CPU", "CPU", None]
    assert events[0].block_hashes == spec["event_block_hashes_u64"]


def test_missing_or_nil_medium_is_gpu() -> None:
    """Older payloads: no medium field (map) or a shorter array, or nil: vLLM's default, GPU."""
    assert decode_event({"type": "BlockRemoved", "block_hashes": [1]}).medium == "GPU"
    assert decode_event({"type": "BlockRemoved", "block_hashes": [1], "medium": None}).medium == "GPU"
    assert decode_event(["BlockRemoved", [1]]).medium == "GPU"
    assert decode_event(["BlockStored", [1], None, list(range(16)), 16, None]).medium == "GPU"
    assert decode_event({"type": "AllBlocksCleared", "medium": "CPU"}).medium == "CPU"
    assert decode_event(["AllBlocksCleared"]).medium is None


def test_digest_hashes_are_read_as_vllms_uint64s() -> None:
    """Connectors that put the digests themselves in an event: their last 8 bytes, as vLLM converts."""
    digest = bytes(range(32))
    stored = decode_event({"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": digest})
    assert stored.block_hashes == [kv_event_hash(digest)] and stored.parent_block_hash == kv_event_hash(
        digest
    )
    assert decode_event(["BlockRemoved", [digest], "CPU"]).block_hashes == [kv_event_hash(digest)]


@pytest.mark.parametrize("as_map", [True, False])
def test_an_unknown_event_type_is_skipped_and_the_rest_of_its_batch_applied(as_map: bool) -> None:
    """A newer vLLM's event type fails the typed decoding of its batch: the batch is then read event
    by event, and the events the mirror knows are kept, in order."""
    import msgspec

    stored = {"type": "BlockStored", "block_hashes": [11, 12], "token_ids": list(range(32)), "block_size": 16}
    removed = {"type": "BlockRemoved", "block_hashes": [b"\x00" * 24 + (12).to_bytes(8, "big")]}
    future = {"type": "BlockPinned", "block_hashes": [11]}
    events = (
        [stored, future, removed]
        if as_map
        else [
            ["BlockStored", [11, 12], None, list(range(32)), 16, None, "CPU"],
            ["BlockPinned", [11]],
            ["BlockRemoved", [12]],
        ]
    )
    ts, decoded, dp_rank = decode_batch(msgspec.msgpack.encode([2.5, events]))
    assert (ts, dp_rank) == (2.5, None)
    assert [e.type for e in decoded] == ["BlockStored", "BlockRemoved"]
    assert decoded[0].medium == ("GPU" if as_map else "CPU") and decoded[1].block_hashes == [12]


def test_a_decoder_that_learned_one_form_still_reads_the_other() -> None:
    """A subscriber's decoder tries the form of its rank's last batch first, never only that one."""
    import msgspec

    from routing.kv_events import EventDecoder

    decoder = EventDecoder()
    as_array = msgspec.msgpack.encode([1.0, [["BlockRemoved", [5], "CPU"]], 3])
    as_map = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [5]}]])
    for payload, medium in ((as_array, "CPU"), (as_array, "CPU"), (as_map, "GPU")):
        _, events, _ = decoder.decode(payload)
        assert isinstance(events[0], BlockRemoved) and events[0].medium == medium
