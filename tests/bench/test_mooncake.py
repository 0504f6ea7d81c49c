"""Mooncake JSONL replay: conversations inferred from shared prefixes, whole families kept, and the
replayed prompts sharing exactly the tokens the trace's ids share."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest

from bench.bench_presets import MOONCAKE_CONVERSATIONS, PRESETS, load_sessions, resolve
from bench.replay import TraceReplayConfig, bound_hit_rate, infinite_cache_bound, replay_trace
from bench.traces import (
    BlockText,
    ChatBuilder,
    UnitCacheBound,
    infer_mooncake_sessions,
    load_mooncake,
    read_mooncake,
    reuse_breakdown,
    trace_block_reuse,
)
from tests.bench.test_traces import _common_prefix
from tests.bench.test_traces import _prompt_tokens as _tokens
from tokenization.tiktoken_tokenizer import encode

# Block 0 starts every request (a global system prompt). Conversation A: a turn re-sending all of the
# previous request but its partial last block, then one re-sending all of it. B shares only block 0.
# Family D: one document (20-22) asked about three times; the third finds 22 already followed by two
# different blocks and is a conversation of its own. F re-sends A's first request only after A moved
# on: a fork, not A's next turn.
LINES = [
    (0, [0, 1, 2, 3], 300),  # A1
    (5_000, [0, 20, 21, 22, 23], 10),  # D1
    (6_000, [0, 20, 21, 22, 24, 25], 10),  # D2: continues D1 (all but its last block)
    (10_000, [0, 10, 11], 20),  # B1
    (20_000, [0, 20, 21, 22, 26], 10),  # D3: 22 is a branch point now
    (30_000, [0, 1, 2, 4, 5, 6], 700),  # A2
    (60_000, [0, 1, 2, 4, 5, 6, 7, 8], 5),  # A3
    (70_000, [0, 1, 2, 9], 5),  # F
]


def _write(path: Path, lines: list[tuple[int, list[int], int]] = LINES) -> Path:
    rows = [
        {"timestamp": t, "input_length": len(ids) * 512 - 100, "output_length": out, "hash_ids": ids}
        for t, ids, out in lines
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    return path


def test_conversations_are_inferred_from_re_sent_prefixes(tmp_path):
    lines = read_mooncake(_write(tmp_path / "t.jsonl"))
    assert infer_mooncake_sessions(lines) == [[0, 5, 6], [1, 2], [3], [4], [7]]


def test_loader_builds_conversations_with_think_times_and_the_common_head(tmp_path):
    sessions = load_mooncake(_write(tmp_path / "t.jsonl"))
    assert [s.key for s in sessions] == ["mooncake-0", "mooncake-1", "mooncake-3", "mooncake-4", "mooncake-7"]
    a = sessions[0]
    assert [r.t_s for r in a.requests] == [0.0, 30.0, 60.0]
    assert [r.think_time_s for r in a.requests] == [0.0, 30.0, 30.0]  # gaps between arrivals
    assert a.requests[1].blocks[:3] == a.requests[0].blocks[:3]  # global ids
    assert a.requests[0].input_tokens == 4 * 512 - 100 and a.requests[0].output_tokens == 300
    assert [s.start_s for s in sessions] == [0.0, 5.0, 10.0, 20.0, 70.0]
    assert {s.head_blocks for s in sessions} == {1}  # block 0 starts every request: the system message
    assert [len(s.requests) for s in load_mooncake(tmp_path / "t.jsonl", max_requests=2)] == [2, 2, 1, 1, 1]
    # a conversation with a request over the limit is skipped whole (A3 is 8 blocks)
    assert "mooncake-0" not in {s.key for s in load_mooncake(tmp_path / "t.jsonl", max_prompt_tokens=7 * 512)}


def test_a_limit_keeps_whole_families_in_order_of_arrival(tmp_path):
    path = _write(tmp_path / "t.jsonl")
    # A's family: its later turns (arriving after four other requests) and the fork F, arriving last
    one = load_mooncake(path, limit=1)
    assert [(s.key, len(s.requests)) for s in one] == [("mooncake-0", 3), ("mooncake-7", 1)]
    assert [s.key for s in load_mooncake(path, limit=2)] == ["mooncake-0", "mooncake-7"]  # families whole
    three = load_mooncake(path, limit=3)
    assert [s.key for s in three] == ["mooncake-0", "mooncake-1", "mooncake-4", "mooncake-7"]
    # the selection keeps all the reuse its requests have in the file
    seen: set[int] = set()
    reused = total = 0
    for _, ids, _ in LINES:
        if ids[1] in (1, 20):  # A's and D's families
            reused += sum(block in seen for block in ids)
            seen.update(ids)
            total += len(ids)
    assert (reused, total) == (21, 38)
    assert trace_block_reuse(three) == pytest.approx(reused / total)


def test_reuse_breakdown_separates_the_head_one_conversation_and_the_others(tmp_path):
    sessions = load_mooncake(_write(tmp_path / "t.jsonl"))
    # 41 blocks; block 0 re-sent by 7 requests; D2 re-sends 3 of D1's, A2 2 and A3 5 of A's own;
    # D3 re-sends 3 of D's and F 2 of A's, each from another conversation
    assert reuse_breakdown(sessions) == pytest.approx(
        {"head": 7 / 41, "same_session": 10 / 41, "across_sessions": 5 / 41}
    )
    assert sum(reuse_breakdown(sessions).values()) == pytest.approx(trace_block_reuse(sessions))


def test_requests_sharing_ids_share_exactly_those_tokens_and_the_bound_equals_the_traces_reuse(tmp_path):
    sessions = load_mooncake(_write(tmp_path / "t.jsonl"))
    text = BlockText(64)
    builders = {s.key: ChatBuilder(s, text, 64) for s in sessions}
    order = sorted((r.t_s, s.key, i) for s in sessions for i, r in enumerate(s.requests))
    bound = UnitCacheBound(16)
    bodies: dict[tuple[str, int], dict] = {}
    for _, key, i in order:
        bodies[key, i] = builders[key].body(i, "m", 8)
        prompt, _ = bound.add(builders[key].units())
        assert prompt == len(_tokens(bodies[key, i]))
    a1, a2, a3 = (_tokens(bodies["mooncake-0", i]) for i in range(3))
    header = len(encode("<|im_start|>system\n"))
    # every turn starts with the same system message (block 0) and the ids it shares with the previous
    assert bodies["mooncake-0", 1]["messages"][0] == bodies["mooncake-0", 0]["messages"][0]
    assert bodies["mooncake-0", 0]["messages"][0]["role"] == "system"
    assert 3 * 64 + header <= _common_prefix(a1, a2) < 4 * 64 + header + 8
    # A3 re-sends A2 whole: A2's messages unchanged, then the answer and the new blocks
    assert bodies["mooncake-0", 2]["messages"][:2] == bodies["mooncake-0", 1]["messages"]
    assert [m["role"] for m in bodies["mooncake-0", 2]["messages"]] == ["system", "user", "assistant", "user"]
    assert _common_prefix(a2, a3) >= len(a2) - 3  # all but the generation prompt
    # across conversations of one family: D3 shares D1's document
    d1, d3 = _tokens(bodies["mooncake-1", 0]), _tokens(bodies["mooncake-4", 0])
    assert _common_prefix(d1, d3) >= 4 * 64 + header
    # the replay's bound (units, and re-tokenized) is the trace's own reuse but for the chat framing
    in_order = [bodies[key, i] for _, key, i in order]
    assert infinite_cache_bound(in_order, 16) == pytest.approx(bound.hit_rate)
    assert bound.hit_rate == pytest.approx(trace_block_reuse(sessions), abs=0.03)


def test_replay_on_one_unlimited_rank_reaches_the_bound_and_each_turn_hits(tmp_path, rank_servers):
    sessions = load_mooncake(_write(tmp_path / "t.jsonl"))
    config = TraceReplayConfig(
        model="prefixgate-sim", concurrency=3, time_scale=0.0005, max_tokens=2, block_tokens=64
    )
    (rank,) = rank_servers.sim(1, kv_tokens=1_000_000)
    result = asyncio.run(asyncio.wait_for(replay_trace(rank.url, sessions, config), 60))
    assert result.errors == [] and result.completed_sessions == 5
    for turn in result.turns:
        assert turn.cached_tokens == turn.bound_hit_tokens, turn
    later_turns = [t for t in result.turns if t.turn > 0]
    assert len(later_turns) == 3 and all(t.cached_tokens >= 3 * 64 for t in later_turns)
    assert bound_hit_rate(result) == pytest.approx(trace_block_reuse(sessions), abs=0.03)


def test_bench_defaults_for_mooncake_leave_claude_code_alone(tmp_path):
    def args(*extra: str) -> argparse.Namespace:
        from proxy.cli import build_parser

        return build_parser().parse_args(["bench", *extra])

    small = PRESETS["small"]
    assert resolve(args()) == small  # Claude Code: the preset as it is
    mooncake = resolve(args("--trace", "mooncake-conversation"))
    assert mooncake.conversations == MOONCAKE_CONVERSATIONS and mooncake.max_requests is None
    explicit = resolve(args("--trace", "mooncake-synthetic", "--conversations", "3", "--max-requests", "1"))
    assert (explicit.conversations, explicit.max_requests) == (3, 1)
    path = _write(tmp_path / "t.jsonl")
    everything, _ = load_sessions(
        resolve(args("--trace", "mooncake-conversation", "--conversations", "0")), path, 0
    )
    assert len(everything) == 5
    sessions, block_tokens = load_sessions(explicit, path, seed=0)
    assert block_tokens == 512
    assert [(s.key, len(s.requests)) for s in sessions] == [
        ("mooncake-0", 1),
        ("mooncake-1", 1),
        ("mooncake-4", 1),
        ("mooncake-7", 1),
    ]


def test_bench_without_matplotlib_says_so_up_front_and_still_writes_its_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Plots are the optional extra's: without matplotlib the run says so before replaying and
    ends with its tables and JSON (it used to fail after the first scenario's replay)."""
    import bench.bench_cmd
    from proxy.cli import build_parser

    monkeypatch.setattr(bench.bench_cmd, "plots_available", lambda: False)
    traces = _write(tmp_path / "t.jsonl")
    replay = ["--trace", "mooncake-synthetic", "--traces", str(traces), "--conversations", "2"]
    systems = ["--max-requests", "1", "--systems", "prefixgate prefix_affinity", "--no-peers"]
    args = build_parser().parse_args(["bench", *replay, *systems, "--out", str(tmp_path / "out")])
    assert args.handler(args) == 0
    assert "no plots (matplotlib is not installed" in capsys.readouterr().err
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    (scenario,) = report["scenarios"].values()
    assert scenario["results"]["prefixgate prefix_affinity"]["errors"] == 0
    assert not list((tmp_path / "out").glob("*.png"))
