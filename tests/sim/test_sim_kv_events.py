"""KV events: encoder bytes vs the shared payloads, and a live ZMQ subscriber on a running rank."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from bench.sim.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
from bench.sim.kv_events import END_SEQ, encode_batch
from tests.helpers.ranks import RankServers
from tokenization.block_hash import BlockHasher

from .conftest import VECTOR_SEED


@pytest.mark.parametrize("version", ["0.33", "0.11"])
def test_encoder_bytes_equal_shared_payloads(shared_dir: Path, version: str) -> None:
    spec = json.loads((shared_dir / "specs" / "vllm_kv_event_payloads.json").read_text())
    expected = next(v for k, v in spec["payloads_hex"].items() if f"vllm-{version}" in k)
    hashes = BlockHasher(16, "sha256", VECTOR_SEED).hash_blocks(list(range(40)))
    events = [BlockStored(hashes, None, list(range(32)), 16), BlockRemoved([hashes[1]]), AllBlocksCleared()]
    assert encode_batch(1700000000.5, events, 0, version).hex() == expected


def _recv(sub: zmq.Socket) -> tuple[list[bytes], list]:
    assert sub.poll(5000), "no KV event within 5 s"
    frames = sub.recv_multipart()
    return frames, msgspec.msgpack.decode(frames[2])


@pytest.mark.parametrize("version", ["0.33", "0.11"])
def test_live_events_and_replay(shared_dir: Path, version: str, rank_servers: RankServers) -> None:
    vectors = json.loads((shared_dir / "specs" / "vllm_hash_vectors.json").read_text())
    expected_u64 = vectors["cases"]["v0.33.0/sha256/PYTHONHASHSEED=0"]["kv_event_block_hashes_u64"][
        "C_tokens_0_39"
    ]
    ctx = zmq.Context.instance()
    (sim,) = rank_servers.sim(
        1, num_blocks=64, hash_seed=VECTOR_SEED, kv_events=True, kv_events_version=version
    )
    sources = httpx.get(f"{sim.url}/kv_event_sources").json()
    assert sources[0]["endpoint"] == sim.kv_events_endpoint
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(sim.kv_events_endpoint)
    try:
        # PUB drops messages until the subscription propagates: probe with resets until one arrives.
        for _ in range(50):
            httpx.post(f"{sim.url}/sim/reset")
            if sub.poll(100):
                break
        while sub.poll(200):
            sub.recv_multipart()
        r = httpx.post(f"{sim.url}/v1/completions", json={"prompt": list(range(40)), "max_tokens": 1})
        assert r.status_code == 200
        frames, payload = _recv(sub)
        assert frames[0] == b"kv" and len(frames[1]) == 8
        ts, events, dp_rank = payload
        assert isinstance(ts, float) and dp_rank == 0
        (stored,) = events
        if version == "0.33":
            assert stored["type"] == "BlockStored"
            assert stored["block_hashes"] == expected_u64
            assert stored["parent_block_hash"] is None and stored["token_ids"] == list(range(32))
            assert stored["block_size"] == 16 and stored["medium"] == "GPU"
        else:
            assert stored[:5] == ["BlockStored", expected_u64, None, list(range(32)), 16]
        last_seq = int.from_bytes(frames[1], "big")

        httpx.post(f"{sim.url}/sim/reset")
        _, (_, events, _) = _recv(sub)
        assert events == ([{"type": "AllBlocksCleared"}] if version == "0.33" else [["AllBlocksCleared"]])

        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(sim.kv_replay_endpoint)
        try:
            dealer.send_multipart([b"", last_seq.to_bytes(8, "big")])
            replies = []
            while True:
                assert dealer.poll(5000)
                reply = dealer.recv_multipart()
                if END_SEQ in reply:
                    break
                replies.append(reply)
            head = [b"", b"kv"] if version == "0.33" else [b""]
            assert [r[: len(head)] for r in replies] == [head, head]
            assert [int.from_bytes(r[len(head)], "big") for r in replies] == [last_seq, last_seq + 1]
            assert msgspec.msgpack.decode(replies[0][-1])[1] == [stored]
        finally:
            dealer.close(0)
    finally:
        sub.close(0)
