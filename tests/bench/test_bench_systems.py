"""``prefixgate bench``'s systems: a plain round robin is the baseline every prefill ratio is read against."""

from __future__ import annotations

import argparse

from bench.bench_cmd import configure_parser, select_systems
from bench.bench_tables import rr_baseline
from bench.systems import PLAIN_ROUND_ROBIN, log_name


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
