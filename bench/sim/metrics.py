"""``/metrics`` of a simulated rank: vLLM's metric names and labels, read from the engine at scrape time."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from bench.sim.latency import NAMES
from bench.sim.rank import SimRank


def cpu_tier_metrics(
    counter: Callable[[str, str, float], CounterMetricFamily], loaded_tokens: int, load_s: float
) -> Iterator[Metric]:
    """vLLM's KV-offloading counters: the tokens its connector loaded back (outside the local
    prefix-cache hits) and the seconds those loads took (as the rank lived them, time-scaled)."""
    yield counter(
        "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms of "
        "number of cached tokens.",
        loaded_tokens,
    )
    yield counter(
        "vllm:kv_offload_load_time", "Total load time from offload storage to GPU, in seconds.", load_s
    )


class RankMetrics(Collector):
    """The counters and gauges vLLM exports (``model_name``/``engine`` labels), for one rank."""

    def __init__(self, rank: SimRank) -> None:
        self.rank = rank

    def collect(self) -> Iterator[Metric]:
        rank = self.rank
        cfg = rank.config
        labels = ["model_name", "engine"]
        values = [cfg.model, "0"]
        c = rank.counters
        engine = rank.engine

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            m = CounterMetricFamily(name, doc, labels=labels)
            m.add_metric(values, value)
            return m

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            m = GaugeMetricFamily(name, doc, labels=labels)
            m.add_metric(values, value)
            return m

        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            c.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            c.prefix_cache_hits,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", rank.pool.usage()
        )
        yield gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.", len(engine.running)
        )
        yield gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.", len(engine.waiting)
        )
        yield counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.", c.num_preemptions
        )
        if rank.engine.cpu_tier is not None:
            yield from cpu_tier_metrics(counter, c.cpu_tier_hits, c.cpu_load_s * cfg.time_scale)
            yield counter(
                "prefixgate_sim:passed_over_cpu_tier",
                "Prompts admitted while another rank held more of them, part in its CPU tier.",
                c.passed_over_cpu_tier,
            )
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", c.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", c.generation_tokens)
        for short, histogram in engine.latencies.histograms.items():
            name, doc = NAMES[short]
            family = HistogramMetricFamily(name, doc, labels=labels)
            family.add_metric(values, histogram.buckets(), histogram.sum)
            yield family
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "num_gpu_blocks",
                "prefix_caching_hash_algo",
            ],
        )
        info.add_metric([str(cfg.block_size), "auto", "True", str(cfg.total_blocks), cfg.hash_algo], 1.0)
        yield info
