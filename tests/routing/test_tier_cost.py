"""What a block held in CPU memory only is worth to routing: its prefill minus loading it back, at
the rank's own measured speeds (``RankSpeeds.cpu_load_costs``), or the documented prior until the
rank has said; and what a rank with KV offloading tells of its loads."""

from __future__ import annotations

import httpx
import pytest

from proxy.admission.learned import MIN_LOADED_TOKENS, RankSpeeds
from routing.policies import make_policy
from routing.policies.bounds import CPU_LOAD_COST_PRIOR, tier_weighed_hit
from routing.policies.protocol import RouteRequest
from routing.rank_metrics import parse_metrics
from routing.ranks import Rank
from tests.helpers.ranks import RankServers


def scrape(prompt: float, gpu_hits: float, prefill_s: float, loaded: float, load_s: float) -> str:
    return (
        f"vllm:prompt_tokens_total {prompt}\nvllm:prefix_cache_hits_total {gpu_hits}\n"
        f"vllm:request_prefill_time_seconds_sum {prefill_s}\nvllm:request_prefill_time_seconds_count 1\n"
        f"vllm:external_prefix_cache_hits_total {loaded}\nvllm:kv_offload_load_time_total {load_s}\n"
    )


def test_the_load_cost_is_load_seconds_per_token_over_prefill_seconds_per_token() -> None:
    speeds = RankSpeeds()
    speeds.observe("r", parse_metrics(scrape(0, 0, 0, 0, 0)))
    assert speeds.cpu_load_costs() == {}  # nothing measured: routing weighs the prior
    # 60k prompt tokens: 20k GPU hits, 20k loaded back (not computed), 20k computed in 2 s;
    # the 20k loaded in 0.1 s: 5e-6 s a token against 1e-4
    speeds.observe("r", parse_metrics(scrape(60_000, 20_000, 2.0, 20_000, 0.1)))
    assert speeds.seconds_per_token("r") == pytest.approx(1e-4)
    assert speeds.cpu_load_costs() == {"r": pytest.approx(0.05)}
    # too few tokens loaded since: the figure stands
    speeds.observe("r", parse_metrics(scrape(60_000, 20_000, 2.0, 20_000 + MIN_LOADED_TOKENS - 1, 1.0)))
    assert speeds.cpu_load_costs() == {"r": pytest.approx(0.05)}


def test_a_rank_without_offload_counters_has_no_load_cost() -> None:
    speeds = RankSpeeds()
    for prompt, seconds in ((0, 0.0), (60_000, 2.0)):
        speeds.observe(
            "r",
            parse_metrics(
                f"vllm:prompt_tokens_total {prompt}\nvllm:request_prefill_time_seconds_sum {seconds}\n"
            ),
        )
    assert speeds.seconds_per_token("r") is not None and speeds.cpu_load_costs() == {}


def test_a_cpu_block_saves_its_prefill_minus_its_load() -> None:
    # 10 blocks of 16 matched, the last 4 in CPU memory only; 8 of them hit this prompt
    assert tier_weighed_hit(8, 10, 4, 16, 0.25) == (8 - 0.25 * 2) * 16
    assert tier_weighed_hit(8, 10, 4, 16, None) == (8 - CPU_LOAD_COST_PRIOR * 2) * 16
    assert tier_weighed_hit(8, 10, 0, 16, 0.25) == 8 * 16
    assert tier_weighed_hit(8, 10, 4, 16, 3.0) == 6 * 16  # loading never costs more than prefilling


def test_routing_prefers_the_gpu_copy_and_a_cpu_copy_over_none() -> None:
    policy = make_policy("prefix_affinity")
    ranks = [Rank("gpu", "http://gpu"), Rank("cpu", "http://cpu"), Rank("none", "http://none")]
    request = RouteRequest(
        session_key="s",
        prompt_tokens=16 * 20 + 1,
        block_hashes=[bytes([i]) * 32 for i in range(20)],
        matched_blocks={"gpu": 20, "cpu": 20},
        offloaded_blocks={"cpu": 12},
    )
    assert [r.name for r in policy.order(request, ranks)] == ["gpu", "cpu", "none"]
    # measured: loading back from "cpu" costs nothing, so both ranks save the whole prefill alike
    # and the tie goes to the session's rendezvous favourite among the two, never to "none"
    request.cpu_load_costs = {"cpu": 0.0}
    assert policy.order(request, ranks)[2].name == "none"
    # a session's own blocks in CPU memory beat a rank holding less of it on its GPU
    request.matched_blocks = {"gpu": 6, "cpu": 20}
    request.cpu_load_costs = {}
    assert policy.order(request, ranks)[0].name == "cpu"


def test_a_simulated_rank_with_a_cpu_tier_says_its_loads(rank_servers: RankServers) -> None:
    (plain,) = rank_servers.sim(1)
    assert parse_metrics(httpx.get(plain.url + "/metrics", timeout=5).text).value("cpu_load_seconds") is None
    (rank,) = rank_servers.sim(1, num_blocks=28, cpu_tier_tokens=4096, cpu_load_rate=100_000.0)
    sample = parse_metrics(httpx.get(rank.url + "/metrics", timeout=5).text)
    assert sample.value("cpu_load_seconds") == 0.0 and sample.value("cpu_loaded_tokens") == 0.0
