"""What prefixgate reads of each rank's own metrics: vLLM's queue, KV and token figures, its latency
histograms, its context length; and the prefill speed admission learns from successive scrapes."""

from __future__ import annotations

import asyncio
import itertools

import aiohttp
import httpx
import pytest

from proxy.admission.learned import MIN_COMPUTED_TOKENS, RankSpeeds
from routing import rank_metrics
from routing.rank_metrics import (
    ON_DEMAND_SPACING,
    RankSample,
    max_model_len_of,
    parse_metrics,
    run_metrics_polls,
)
from routing.ranks import Fleet, Rank
from tests.helpers.wait import wait_until_async

VLLM = """\
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 2.0
vllm:num_requests_running{engine="0",model_name="m"} 7.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42
vllm:prompt_tokens_total{engine="0",model_name="m"} 120000.0
vllm:gpu_prefix_cache_hits_total{engine="0",model_name="m"} 20000.0
vllm:request_prefill_time_seconds_bucket{engine="0",le="0.5",model_name="m"} 4.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 2.5
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 5.0
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="m"} 9.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="m"} 5.0
vllm:cache_config_info{block_size="16",num_gpu_blocks="1000"} 1.0
"""


def test_a_vllm_exposition_is_read_summed_over_its_engines() -> None:
    sample = parse_metrics(VLLM, at=1.0)
    assert sample.value("waiting") == 5.0 and sample.value("running") == 7.0
    assert sample.value("kv_usage") == 0.42
    assert (sample.value("prompt_tokens"), sample.value("cached_tokens")) == (120_000.0, 20_000.0)
    prefill = sample.histogram("prefill")
    assert prefill is not None and (prefill.sum, prefill.count) == (2.5, 5.0)
    assert sample.histogram("e2e") is not None and sample.histogram("ttft") is None


def test_the_context_length_is_the_largest_model_cards() -> None:
    cards = {"data": [{"id": "a", "max_model_len": 8192}, {"id": "b", "max_model_len": 32768}, {"id": "c"}]}
    assert max_model_len_of(cards) == 32768
    assert max_model_len_of({"data": [{"id": "x"}]}) is None
    assert max_model_len_of(["not", "cards"]) is None


def scrape(prompt: float, cached: float, prefill_s: float) -> str:
    return (
        f"vllm:prompt_tokens_total {prompt}\nvllm:prefix_cache_hits_total {cached}\n"
        f"vllm:request_prefill_time_seconds_sum {prefill_s}\nvllm:request_prefill_time_seconds_count 1\n"
    )


def test_a_ranks_speed_is_prefill_time_per_computed_token() -> None:
    speeds = RankSpeeds()
    speeds.observe("r", parse_metrics(scrape(0, 0, 0)))
    assert speeds.seconds_per_token("r") is None
    speeds.observe("r", parse_metrics(scrape(MIN_COMPUTED_TOKENS - 1, 0, 1.0)))
    assert speeds.seconds_per_token("r") is None  # too little computed to say
    speeds.observe("r", parse_metrics(scrape(60_000, 20_000, 2.0)))  # 40k computed in 2 s
    assert speeds.tokens_per_second("r") == 20_000
    assert speeds.seconds_per_token("other") == speeds.seconds_per_token("r")  # the fleet's, meanwhile
    speeds.observe("r", parse_metrics(scrape(100, 0, 0.01)))  # counters restarted: a new base
    assert speeds.tokens_per_second("r") == 20_000


def test_hits_counted_before_their_prompts_are_no_restart() -> None:
    """vLLM counts a request's prefix-cache hits when it is scheduled and its prompt tokens at its
    first token: computed tokens (prompt - hits) can fall between two scrapes. The base stays, so
    the next scrape measures the whole span."""
    speeds = RankSpeeds()
    speeds.observe("r", parse_metrics(scrape(0, 0, 0)))
    speeds.observe("r", parse_metrics(scrape(1_000, 2_163, 0.07)))  # hits ahead of prompts
    speeds.observe("r", parse_metrics(scrape(60_000, 20_000, 2.0)))  # 40k computed in 2 s since 0
    assert speeds.tokens_per_second("r") == 20_000


def test_a_simulated_rank_exposes_them_like_vllm(rank_servers) -> None:  # type: ignore[no-untyped-def]
    (rank,) = rank_servers.sim(1, time_scale=0.001)
    body = {"model": "m", "messages": [{"role": "user", "content": "word " * 3000}], "max_tokens": 4}
    assert httpx.post(rank.url + "/v1/chat/completions", json=body, timeout=20).status_code == 200
    sample = parse_metrics(httpx.get(rank.url + "/metrics", timeout=5).text)
    assert sample.value("prompt_tokens") and sample.value("prompt_tokens") >= 3000  # type: ignore[operator]
    for name in ("prefill", "ttft", "queue", "e2e"):
        histogram = sample.histogram(name)
        assert histogram is not None and histogram.count == 1 and histogram.sum >= 0
    assert sample.histogram("prefill").sum > 0  # type: ignore[union-attr]
    cards = httpx.get(rank.url + "/v1/models", timeout=5).json()
    assert max_model_len_of(cards) == rank.config.max_model_len


def test_a_scrape_is_wanted_only_while_no_rank_is_measured() -> None:
    speeds = RankSpeeds()
    speeds.wanted()
    assert speeds.sooner.is_set()
    speeds.sooner.clear()
    speeds.observe("r", parse_metrics(scrape(0, 0, 0)))
    speeds.observe("r", parse_metrics(scrape(60_000, 20_000, 2.0)))
    speeds.wanted()
    assert not speeds.sooner.is_set()  # measured: the regular polls are enough


def test_the_poller_scrapes_again_as_soon_as_it_is_asked(rank_servers) -> None:  # type: ignore[no-untyped-def]
    (sim,) = rank_servers.sim(1, time_scale=0.001)
    fleet = Fleet([Rank("r0", sim.url)])
    samples: list[RankSample] = []
    sooner = asyncio.Event()

    async def scenario() -> None:
        async with aiohttp.ClientSession() as client:
            poller = asyncio.create_task(
                run_metrics_polls(client, fleet, 3600.0, 5.0, lambda _, s: samples.append(s), sooner)
            )
            try:
                await wait_until_async(lambda: len(samples) == 1, "no first scrape")
                sooner.set()  # an hour before the next regular poll
                await wait_until_async(lambda: len(samples) == 2, "asked, but no second scrape")
                assert not sooner.is_set()  # cleared for the next ask
            finally:
                poller.cancel()

    asyncio.run(scenario())


def test_no_scrape_is_wanted_when_no_ranks_metrics_can_give_a_speed() -> None:
    """Ranks without prefill or TTFT histograms are never measured: asking for a scrape per answer
    would scrape them once per answer for as long as sessions wait."""
    speeds = RankSpeeds()
    speeds.observe("r", parse_metrics("vllm:prompt_tokens_total 100\nvllm:num_requests_waiting 2\n"))
    speeds.wanted()
    assert not speeds.sooner.is_set()
    speeds.observe("s", parse_metrics(scrape(0, 0, 0)))  # one rank that can be measured: ask again
    speeds.wanted()
    assert speeds.sooner.is_set()


def test_scrapes_asked_for_without_pause_are_spaced_by_their_own_duration(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    scrapes: list[tuple[float, float]] = []
    sooner = asyncio.Event()

    async def slow_poll(*_: object) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.sleep(0.02)
        scrapes.append((started, loop.time()))
        sooner.set()  # asked again at once, as every answer of a waiting wave would

    monkeypatch.setattr(rank_metrics, "poll_all", slow_poll)

    async def scenario() -> None:
        poller = asyncio.create_task(
            run_metrics_polls(None, Fleet([]), 3600.0, 5.0, lambda *_: None, sooner)  # type: ignore[arg-type]
        )
        try:
            await wait_until_async(lambda: len(scrapes) >= 3, "asked, but no further scrapes")
        finally:
            poller.cancel()

    asyncio.run(scenario())
    for (start, end), (next_start, _) in itertools.pairwise(scrapes):
        assert next_start - end >= (ON_DEMAND_SPACING - 1) * (end - start) - 1e-3
