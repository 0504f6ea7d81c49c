"""Trace loaders (Claude Code JSON, Mooncake JSONL), the id -> text mapping and the chat bodies built."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from bench.traces import (
    CLAUDE_CODE_DIR,
    BlockText,
    ChatBuilder,
    TraceRequest,
    TraceSession,
    TracesMissing,
    UnitCacheBound,
    claude_code_paths,
    load_claude_code,
    load_claude_code_trace,
    load_mooncake,
    trace_block_reuse,
)
from tokenization.tiktoken_tokenizer import encode, render_segments


def _request(t: float, ids: list[int], out: int = 100, think: float = 0.0) -> dict:
    return {"t": t, "type": "s", "in": len(ids) * 64, "out": out, "hash_ids": ids, "think_time": think}


def _write_trace(path: Path, trace_id: str, requests: list[dict], head_tokens: int = 128) -> Path:
    data = {
        "id": trace_id,
        "block_size": 64,
        "hash_id_scope": "local",
        "tool_tokens": head_tokens // 2,
        "system_tokens": head_tokens // 2,
        "requests": requests,
    }
    with gzip.open(path, "wt") as handle:
        json.dump(data, handle)
    return path


def _prompt_tokens(body: dict) -> list[int]:
    tokens: list[int] = []
    for segment in render_segments(body["messages"], None, True):
        tokens.extend(encode(segment))
    return tokens


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def test_block_text_is_deterministic_exact_and_distinct():
    text = BlockText(64, seed=0)
    chunk = text.text(("t1", 5))
    assert chunk == BlockText(64, seed=0).text(("t1", 5))  # same id, same text, in any process
    assert len(encode(chunk)) == 64
    assert text.text(("t1", 6)) != chunk and text.text(("t2", 5)) != chunk  # ids are namespaced
    assert BlockText(64, seed=1).text(("t1", 5)) != chunk
    # chunks concatenate without merging across their boundaries
    joined = text.join([("t1", i) for i in range(10)])
    assert len(encode(joined)) == 640
    assert len(encode(BlockText(512).text(("mooncake", 1)))) == 512


def test_claude_code_loader_shares_the_head_across_traces_and_keeps_subagents(tmp_path):
    sub = {
        "t": 5.0,
        "type": "subagent",
        "agent_id": "agent_001",
        "subagent_type": "Explore",
        "tool_tokens": 64,
        "system_tokens": 64,
        "requests": [_request(0.0, [100, 101, 102]), _request(2.0, [100, 101, 102, 103], think=1.0)],
    }
    _write_trace(
        tmp_path / "trace_0001.json.gz",
        "trace_0001",
        [_request(0.0, [1, 2, 3, 4]), sub, _request(9.0, [1, 2, 3, 4, 5, 6], think=3.0)],
    )
    _write_trace(tmp_path / "trace_0002.json.gz", "trace_0002", [_request(0.0, [1, 2, 7])])
    first, second = load_claude_code(tmp_path)
    assert [len(r.blocks) for r in first.requests] == [4, 6]
    assert first.requests[1].think_time_s == 3.0
    # the first (tool + system) / 64 = 2 blocks are one shared set of ids across traces
    assert first.requests[0].blocks[:2] == second.requests[0].blocks[:2]
    assert first.requests[0].blocks[2] != second.requests[0].blocks[2]  # local ids stay local
    assert first.head_blocks == 2
    # the sub-agent is a session of its own, started before the parent's second request
    (child,) = first.children[1]
    assert child.key == "trace_0001/agent_001" and len(child.requests) == 2
    assert child.start_s == 5.0
    assert [s.key for s in first.all_sessions()] == ["trace_0001", "trace_0001/agent_001"]
    assert trace_block_reuse(first.all_sessions()) == pytest.approx((4 + 3) / (4 + 6 + 3 + 4))


def test_filters_on_the_largest_request_and_truncates(tmp_path, monkeypatch):
    monkeypatch.setattr("bench.traces.claude_code.INDEX_CACHE", tmp_path / "index.json")
    _write_trace(tmp_path / "trace_0001.json.gz", "a", [_request(0, [1, 2]), _request(1, [1, 2, 3, 4])])
    _write_trace(tmp_path / "trace_0002.json.gz", "b", [_request(0, [1, 2, 3])])
    assert [s.key for s in load_claude_code(tmp_path, max_prompt_tokens=3 * 64)] == ["b"]
    assert (tmp_path / "index.json").exists()
    assert [s.key for s in load_claude_code(tmp_path, max_prompt_tokens=3 * 64)] == ["b"]  # from the index
    (a, b) = load_claude_code(tmp_path, max_requests=1)
    assert len(a.requests) == 1 and len(b.requests) == 1
    assert len(load_claude_code(tmp_path, limit=1)) == 1


def test_a_request_that_extends_the_previous_resends_its_messages_unchanged():
    blocks = [("s", 0), ("s", 1)] + [("t", i) for i in range(2, 8)]
    session = TraceSession(
        key="k",
        head_blocks=2,
        requests=[
            TraceRequest(tuple(blocks[:4]), 256, 64),
            TraceRequest(tuple(blocks[:7]), 448, 64),  # extends: previous answer + new blocks
            TraceRequest((*tuple(blocks[:3]), ("t", 99)), 256, 64),  # keeps only part of it
        ],
    )
    builder = ChatBuilder(session, BlockText(64), 64)
    first = builder.body(0, "m", 8)
    second = builder.body(1, "m", 8)
    assert [m["role"] for m in first["messages"]] == ["system", "user"]
    assert second["messages"][:2] == first["messages"]  # re-sent unchanged
    assert [m["role"] for m in second["messages"][2:]] == ["assistant", "user"]
    t1, t2 = _prompt_tokens(first), _prompt_tokens(second)
    # the whole first prompt but its generation prompt is a prefix of the second
    assert _common_prefix(t1, t2) >= len(t1) - 3
    third = builder.body(2, "m", 8)
    assert third["messages"][0] == first["messages"][0]  # the system message (shared head) is kept
    assert len(third["messages"]) == 2
    assert third["stream"] is True and third["stream_options"] == {"include_usage": True}


def test_units_match_the_rendered_tokens_and_the_bound_counts_whole_blocks():
    ids = [("s", 0), ("s", 1), ("t", 2), ("t", 3), ("t", 4)]
    session = TraceSession(
        key="k",
        head_blocks=2,
        requests=[TraceRequest(tuple(ids[:3]), 192, 10), TraceRequest(tuple(ids), 320, 10)],
    )
    builder = ChatBuilder(session, BlockText(64), 64)
    bound = UnitCacheBound(16)
    bodies = []
    results = []
    for i in range(2):
        bodies.append(builder.body(i, "m", 8))
        units = builder.units()
        assert sum(n for _, n in units) == len(_prompt_tokens(bodies[-1]))
        results.append(bound.add(units))
    assert results[0][1] == 0  # nothing seen before
    prompt, hits = results[1]
    shared = _common_prefix(_prompt_tokens(bodies[0]), _prompt_tokens(bodies[1]))
    # the second request re-sends the first whole (generation prompt included): the bound credits it
    # in whole 16-token blocks, and never more than the rendered prompts really share
    assert hits == results[0][0] // 16 * 16
    assert 0 < hits <= shared
    assert bound.hit_rate == pytest.approx(hits / (results[0][0] + prompt))


def test_mooncake_loader(tmp_path):
    path = tmp_path / "trace.jsonl"
    lines = [
        {"timestamp": 1000, "input_length": 1000, "output_length": 10, "hash_ids": [0, 1]},
        {"timestamp": 3500, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, 2]},
        {"timestamp": 4000, "input_length": 99999, "output_length": 20, "hash_ids": [5] * 196},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    # the second request re-sends the first: one conversation
    (session,) = load_mooncake(path, max_prompt_tokens=10_000)
    assert [r.t_s for r in session.requests] == [0.0, 2.5]
    assert session.requests[1].blocks[:2] == session.requests[0].blocks  # global ids
    assert session.requests[1].output_tokens == 20
    builder = ChatBuilder(session, BlockText(512), 512)
    a = builder.body(0, "m", 8)
    b = builder.body(1, "m", 8)
    assert b["messages"][0]["content"].startswith(a["messages"][0]["content"])
    assert len(load_mooncake(path, limit=1)) == 1


def test_missing_traces_raise_a_clear_error(tmp_path):
    with pytest.raises(TracesMissing, match="not on this machine"):
        claude_code_paths(tmp_path / "nope")
    with pytest.raises(TracesMissing):
        load_mooncake(tmp_path / "nope.jsonl")
    with pytest.raises(TracesMissing):
        load_claude_code_trace(tmp_path / "trace_9999.json.gz")


@pytest.mark.skipif(not CLAUDE_CODE_DIR.exists(), reason="../shared/traces is not on this machine")
def test_a_real_claude_code_trace_renders_to_about_its_recorded_token_counts():
    session = load_claude_code_trace(claude_code_paths()[0])
    builder = ChatBuilder(session, BlockText(64), 64)
    for index, request in enumerate(session.requests[:3]):
        builder.body(index, "m", 8)
        tokens = sum(n for _, n in builder.units())
        # blocks x 64 plus a few template tokens per message: within 2 % of what the trace recorded
        assert abs(tokens - request.input_tokens) <= 0.02 * request.input_tokens
