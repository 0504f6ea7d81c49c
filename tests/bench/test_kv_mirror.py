"""``python -m bench.kv_mirror``: a simulated rank's KV feed is recorded, kept and replayed."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench import kv_mirror

SMALL = ["--sessions", "3", "--turns", "3", "--head-tokens", "400", "--turn-tokens", "50", "200"]
SMALL += ["--answer-tokens", "40", "--kv-tokens", "1024", "--cpu-tier", "2", "--rounds", "2"]


def test_a_feed_is_recorded_kept_and_replayed_the_same(tmp_path: Path) -> None:
    feed, first, second = tmp_path / "feed.bin", tmp_path / "a.json", tmp_path / "b.json"
    assert kv_mirror.main([*SMALL, "--payloads", str(feed), "--out", str(first)]) == 0
    recorded = json.loads(first.read_text())
    # a pool of 64 blocks for three growing sessions: it evicts, and its CPU tier takes blocks
    assert recorded["batches"] > 0 and recorded["events"] > recorded["batches"]
    assert recorded["mirror"].endswith("routing/kv_events.py") and len(recorded["seconds"]) == 2
    assert kv_mirror.main([*SMALL, "--payloads", str(feed), "--out", str(second)]) == 0
    replayed = json.loads(second.read_text())
    assert (replayed["batches"], replayed["events"]) == (recorded["batches"], recorded["events"])


def test_the_recorded_feed_evicts_and_offloads() -> None:
    import msgspec

    args = argparse.Namespace(
        sessions=3,
        turns=3,
        head_tokens=400,
        turn_tokens=(50, 200),
        answer_tokens=40,
        block_size=16,
        kv_tokens=1024,
        cpu_tier=2,
        seed=0,
    )
    kinds = {
        (event["type"], event["medium"])
        for payload in kv_mirror.record(args)
        for event in msgspec.msgpack.decode(payload)[1]
    }
    assert {("BlockStored", "GPU"), ("BlockRemoved", "GPU"), ("BlockStored", "CPU")} <= kinds


def test_another_tree_needs_a_recorded_feed(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        kv_mirror.main(["--tree", str(tmp_path), "--payloads", str(tmp_path / "none.bin")])
