"""Trace replay against a simulated rank: what the rank reports matches the computed bound exactly."""

from __future__ import annotations

import asyncio

import pytest

from bench.plots import windowed_hit_rate
from bench.replay import TraceReplayConfig, bound_hit_rate, replay_trace
from bench.traces import TraceRequest, TraceSession
from tests.helpers.lockstep import replay_lockstep


def _session(key: str, local: str, turns: int, think_s: float = 0.0) -> TraceSession:
    head = [("shared", i) for i in range(3)]
    requests = []
    blocks = list(head)
    for turn in range(turns):
        blocks = blocks + [(local, 10 * turn + j) for j in range(2 + turn)]
        requests.append(TraceRequest(tuple(blocks), len(blocks) * 64, 40, think_time_s=think_s))
    return TraceSession(key=key, requests=requests, head_blocks=3)


@pytest.mark.parametrize("replay", [replay_trace, replay_lockstep])
def test_one_unlimited_rank_reports_exactly_the_infinite_cache_bound(rank_servers, replay):
    parent = _session("a", "a", 4, think_s=1.0)
    parent.children[2] = [_session("a/sub", "sub", 2)]  # a sub-agent, before the parent's 3rd request
    sessions = [parent, _session("b", "b", 3)]
    config = TraceReplayConfig(model="prefixgate-sim", concurrency=2, time_scale=0.001, max_tokens=2)
    (rank,) = rank_servers.sim(1, kv_tokens=1_000_000)
    result = asyncio.run(asyncio.wait_for(replay(rank.url, sessions, config), 60))
    assert result.errors == []
    assert len(result.turns) == 4 + 2 + 3
    assert result.completed_sessions == 3
    # one rank that never evicts reaches the bound, request by request: the bound is computed right
    for turn in result.turns:
        assert turn.cached_tokens == turn.bound_hit_tokens, turn
    assert 0.5 < bound_hit_rate(result) == pytest.approx(result.summary()["hit_rate"])
    # the second session (and the sub-agent) found the shared head cached on its first request
    firsts = [t for t in result.turns if t.turn == 0]
    assert sorted(t.cached_tokens > 0 for t in firsts) == [False, True, True]


def test_windowed_hit_rate():
    turns = [
        {"sent_s": 2.0, "prompt_tokens": 100, "cached_tokens": 100},
        {"sent_s": 1.0, "prompt_tokens": 100, "cached_tokens": 0},
        {"sent_s": 3.0, "prompt_tokens": 100, "cached_tokens": 50},
    ]
    assert windowed_hit_rate(turns, 2) == ([2, 3], [0.5, 0.75])


def test_bench_command_stops_with_a_clear_message_without_traces(tmp_path, capsys):
    from proxy.cli import build_parser

    args = build_parser().parse_args(["bench", "--traces", str(tmp_path / "absent"), "--out", str(tmp_path)])
    assert args.handler(args) == 2
    assert "not on this machine" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()
