"""``bench.replica_replay`` on each Redis topology: replicas behind HAProxy on one server, a Redis
Cluster or a master watched by Sentinel answer every request of a small lockstep replay, keep each
session on one rank, and the Redis counters are read from every master."""

from __future__ import annotations

import pytest

from bench.replica_replay import TOPOLOGIES, arguments, run_system
from bench.traces import TraceRequest, TraceSession


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
    flags = ["--lockstep", "--concurrency", "4", "--think-scale", "0.01", "--time-scale", "0"]
    args = arguments(["--redis", topology, *flags])
    row = run_system(2, sessions, args, kv_tokens=100_000)
    assert row["system"].startswith("2 replicas + HAProxy")
    assert row["errors"] == 0, row["error_samples"]
    assert row["requests"] == row["requests_sent"] == 16
    assert row["completed_sessions"] == 4
    assert row["sessions_on_two_ranks"] == 0
    # every returning turn found on its rank all that one infinite cache would hold (the pools are
    # far larger than the sessions): the replicas sent it where its earlier turns went
    returning = [t for t in row["turns"] if t["turn"] > 0]
    assert len(returning) == 12
    assert all(t["cached_tokens"] == t["bound_hit_tokens"] > 0 for t in returning), returning
    # the scripts that keep the replicas' state ran on the topology's masters and were counted there
    assert row["redis_commands"].get("evalsha", 0) > 0


def test_a_redis_restart_is_refused_off_a_single_server() -> None:
    with pytest.raises(SystemExit):
        arguments(["--redis", "cluster", "--restart-redis-at", "5"])


def test_replicas_fed_by_the_ranks_kv_events_answer_every_request_and_find_each_turn_on_its_rank() -> None:
    # --kv-events: the simulated ranks publish KV events and every replica subscribes, so what each
    # routes on is what the ranks report holding (and blocks routed a moment ago, in flight)
    sessions = [_session(f"s{i}", 4) for i in range(4)]
    flags = ["--lockstep", "--concurrency", "4", "--think-scale", "0.01", "--time-scale", "0"]
    args = arguments(["--redis", "server", "--kv-events", *flags])
    row = run_system(2, sessions, args, kv_tokens=100_000)
    assert row["errors"] == 0, row["error_samples"]
    assert row["requests"] == row["requests_sent"] == 16
    assert row["sessions_on_two_ranks"] == 0
    # both replicas mirrored the ranks' events (each turn's blocks stored), and no feed met a fault
    assert row["kv_events"]["applied"] >= 2 * 16
    assert row["kv_events"]["faults"] == 0
    returning = [t for t in row["turns"] if t["turn"] > 0]
    assert len(returning) == 12
    assert all(t["cached_tokens"] == t["bound_hit_tokens"] > 0 for t in returning), returning
