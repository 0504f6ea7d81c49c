"""Replicas replaying a small lockstep trace on each Redis topology: replicas behind HAProxy on one
server, a Redis Cluster or a master watched by Sentinel answer every request, keep each session on
one rank, and the scripts that keep their state run on the topology's masters; fed by the ranks' KV
events, both replicas mirror the events and find each turn on its rank."""

from __future__ import annotations

import pytest

from bench.traces import TraceRequest, TraceSession
from tests.helpers.replica_replay import TOPOLOGIES, replay_through_replicas


def _session(key: str, turns: int) -> TraceSession:
    blocks: list[tuple[str, int]] = [("shared", i) for i in range(3)]
    requests = []
    for turn in range(turns):
        blocks = blocks + [(key, 10 * turn + j) for j in range(2)]
        requests.append(TraceRequest(tuple(blocks), len(blocks) * 64, 8, think_time_s=0.5))
    return TraceSession(key=key, requests=requests, head_blocks=3)


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_replicas_on_each_topology_answer_every_request_and_keep_each_session_on_one_rank(
    topology: str,
) -> None:
    sessions = [_session(f"s{i}", 4) for i in range(4)]
    replay = replay_through_replicas(sessions, topology)
    result = replay.result
    assert result.errors == []
    assert len(result.turns) == replay.requests_sent == 16
    assert result.completed_sessions == 4
    assert replay.sessions_on_two_ranks() == 0
    # every returning turn found on its rank all that one infinite cache would hold (the pools are
    # far larger than the sessions): the replicas sent it where its earlier turns went
    returning = [t for t in result.turns if t.turn > 0]
    assert len(returning) == 12
    assert all(t.cached_tokens == t.bound_hit_tokens > 0 for t in returning), returning
    # the scripts that keep the replicas' state ran on the topology's masters and were counted there
    assert replay.redis_commands.get("evalsha", 0) > 0


def test_replicas_fed_by_the_ranks_kv_events_answer_every_request_and_find_each_turn_on_its_rank() -> None:
    # KV events: the simulated ranks publish them and every replica subscribes, so what each routes
    # on is what the ranks report holding (and blocks routed a moment ago, in flight)
    sessions = [_session(f"s{i}", 4) for i in range(4)]
    replay = replay_through_replicas(sessions, "server", kv_events=True)
    result = replay.result
    assert result.errors == []
    assert len(result.turns) == replay.requests_sent == 16
    assert replay.sessions_on_two_ranks() == 0
    # both replicas mirrored the ranks' events (each turn's blocks stored), and no feed met a fault
    assert replay.kv_events_applied >= 2 * 16
    assert replay.kv_event_faults == 0
    returning = [t for t in result.turns if t.turn > 0]
    assert len(returning) == 12
    assert all(t.cached_tokens == t.bound_hit_tokens > 0 for t in returning), returning
