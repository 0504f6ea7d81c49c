"""``prefixgate bench``'s systems: a plain round robin is the baseline every prefill ratio is read against."""

from __future__ import annotations

import argparse

import httpx

from bench.bench_cmd import configure_parser, select_systems
from bench.bench_run import session_moves
from bench.bench_tables import rr_baseline
from bench.systems import PLAIN_ROUND_ROBIN, log_name
from tests.helpers.gateway import Gateways
from tests.helpers.ranks import RankServers


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    return parser.parse_args(list(argv))


def test_plain_round_robin_runs_first_with_every_stage_off() -> None:
    systems, _ = select_systems(parse("--no-peers"))
    assert systems[0] is PLAIN_ROUND_ROBIN
    assert systems[0].policy == "round_robin"
    assert set(systems[0].args) == {"--no-admission", "--no-canonicalize"}
    # prefixgate's own round robin (admission and canonicalization on) is still there, apart
    assert any(s.name == "prefixgate round_robin" and not s.args for s in systems)


def test_systems_by_name() -> None:
    systems, _ = select_systems(parse("--no-peers", "--systems", "plain:round_robin,prefixgate:round_robin"))
    assert [s.name for s in systems] == ["plain round_robin", "prefixgate round_robin"]


def test_a_system_from_another_source_tree_runs_beside_this_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    tree = tmp_path / "base"
    wanted = (
        f"prefixgate:round_robin,prefixgate@{tree}:round_robin,prefixgate@{tree}:round_robin:--no-admission"
    )
    systems, _ = select_systems(parse("--no-peers", "--systems", wanted))
    assert [s.name for s in systems] == [
        "prefixgate round_robin",
        "prefixgate@base round_robin",
        "prefixgate@base round_robin --no-admission",
    ]
    assert [s.root for s in systems] == [None, tree, tree] and systems[2].args == ("--no-admission",)


def test_the_ratio_baseline_is_the_plain_round_robin_when_it_ran() -> None:
    both = {"plain round_robin": {"prefill_tokens": 30}, "prefixgate round_robin": {"prefill_tokens": 20}}
    assert rr_baseline(both) == 30
    assert rr_baseline({"prefixgate round_robin": {"prefill_tokens": 20}}) == 20
    assert rr_baseline({}) is None


def test_a_systems_log_is_one_file_in_the_log_folder_whatever_its_flags() -> None:
    name = log_name("prefixgate prefix_affinity --config /tmp/a b.yaml")
    assert "/" not in name and " " not in name and name.endswith(".log")
    assert log_name("vllm-router consistent_hash") == "vllm-router_consistent_hash.log"


def test_the_bench_reads_prefixgates_session_moves_by_what_the_left_rank_held(
    rank_servers: RankServers,
) -> None:
    """A session whose rank refuses it moves; ``session_moves`` reads the count off ``/metrics``."""
    ranks = rank_servers.sim(2, time_scale=0.001)
    gateways = Gateways(health_interval=0.2, health_timeout=1.0, policy="prefix_affinity")
    try:
        proxy = gateways(ranks, retries=1)
        assert session_moves(proxy.url) == {"gpu": 0.0, "cpu": 0.0, "none": 0.0}
        messages = [{"role": "user", "content": "Fix the flaky test in the repository. " * 40}]
        body = {"model": "prefixgate-sim", "messages": messages, "max_tokens": 4}
        headers = {"x-session-id": "moving"}
        first = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
        home = first.headers["x-prefixgate-backend"]
        next(rank for rank in ranks if rank.config.name == home).set_faults(refuse_connections=True)
        messages += [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Next."}]
        second = httpx.post(proxy.url + "/v1/chat/completions", json=body, headers=headers, timeout=10)
        assert second.status_code == 200 and second.headers["x-prefixgate-backend"] != home
        moves = session_moves(proxy.url)
        assert moves is not None and sum(moves.values()) == 1.0 and moves["cpu"] == 0.0, moves
    finally:
        gateways.stop_all()
