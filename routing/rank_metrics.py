"""What each rank says about its own load and speed: its ``GET /metrics``, polled beside the health
checks (never per request), and its ``max_model_len`` from ``GET /v1/models``.

A ``RankSample`` holds the figures vLLM exports that admission reads: the scheduler's queues
(``vllm:num_requests_waiting`` / ``running``), KV use (``vllm:kv_cache_usage_perc``), the prompt
and prefix-cache-hit token counters, and the sums and counts of its per-request histograms (time
in prefill, time to first token, time queued, whole request), and with KV offloading the tokens
loaded back from CPU memory and the seconds that took. Counters and histograms are summed
over the label sets a rank reports (one per engine, one per model). Older vLLM names
(``gpu_cache_usage_perc``, ``gpu_prefix_cache_hits``) are read too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import orjson

from routing.ranks import Fleet, Rank

log = logging.getLogger("prefixgate.health")

#: Gauges and counters read, by the name a sample keeps (Prometheus adds ``_total`` to counters).
SCALARS = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prefix_cache_hits_total": "cached_tokens",
    "vllm:gpu_prefix_cache_hits_total": "cached_tokens",
    # KV offloading (vLLM's OffloadingConnector): prompt tokens its connector loaded back instead
    # of prefilling (the CPU tier's hits, outside ``cached_tokens``), and the seconds those loads took.
    "vllm:external_prefix_cache_hits_total": "cpu_loaded_tokens",
    "vllm:kv_offload_load_time_total": "cpu_load_seconds",
}
#: Histograms read (their ``_sum`` and ``_count``).
HISTOGRAMS = {
    "vllm:request_prefill_time_seconds": "prefill",
    "vllm:time_to_first_token_seconds": "ttft",
    "vllm:request_queue_time_seconds": "queue",
    "vllm:e2e_request_latency_seconds": "e2e",
}


@dataclass(frozen=True, slots=True)
class Histogram:
    """A histogram's running sum (seconds) and count (requests)."""

    sum: float = 0.0
    count: float = 0.0


@dataclass(frozen=True, slots=True)
class RankSample:
    """One scrape of a rank's ``/metrics`` (``at``: ``time.monotonic()`` when it was read)."""

    at: float
    values: dict[str, float] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)

    def value(self, name: str) -> float | None:
        return self.values.get(name)

    def histogram(self, name: str) -> Histogram | None:
        return self.histograms.get(name)


def parse_metrics(text: str, at: float | None = None) -> RankSample:
    """The figures of ``SCALARS`` and ``HISTOGRAMS`` in a Prometheus text exposition."""
    values: dict[str, float] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        key = SCALARS.get(name)
        target = values
        if key is None:
            base, _, part = name.rpartition("_")
            key = HISTOGRAMS.get(base) if part in ("sum", "count") else None
            if key is None:
                continue
            target = sums if part == "sum" else counts
        try:
            number = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        target[key] = target.get(key, 0.0) + number
    histograms = {k: Histogram(sums.get(k, 0.0), counts.get(k, 0.0)) for k in sums.keys() | counts.keys()}
    return RankSample(time.monotonic() if at is None else at, values, histograms)


async def fetch_sample(client: aiohttp.ClientSession, rank: Rank, timeout: float) -> RankSample | None:
    """One scrape of ``rank``'s ``/metrics`` (None when it does not answer)."""
    try:
        async with client.get(f"{rank.url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as answer:
            if answer.status != 200:
                return None
            text = (await answer.read()).decode("utf-8", "replace")
    except (aiohttp.ClientError, TimeoutError):
        return None
    return parse_metrics(text)


def max_model_len_of(cards: object) -> int | None:
    """The largest ``max_model_len`` of a ``/v1/models`` answer's cards (vLLM reports it per card)."""
    if not isinstance(cards, dict) or not isinstance(cards.get("data"), list):
        return None
    lengths = [
        card["max_model_len"]
        for card in cards["data"]
        if isinstance(card, dict) and isinstance(card.get("max_model_len"), int) and card["max_model_len"] > 0
    ]
    return max(lengths, default=None)


async def learn_max_model_len(client: aiohttp.ClientSession, rank: Rank, timeout: float) -> None:
    """``rank.max_model_len`` from its ``/v1/models``, when it says."""
    limit = aiohttp.ClientTimeout(total=timeout)
    try:
        async with client.get(f"{rank.url}/v1/models", timeout=limit) as answer:
            if answer.status != 200:
                return
            cards = orjson.loads(await answer.read())
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError):
        return
    length = max_model_len_of(cards)
    if length is not None and length != rank.max_model_len:
        rank.max_model_len = length
        log.info("rank %s: max_model_len %d", rank.name, length)


async def poll_all(
    client: aiohttp.ClientSession,
    fleet: Fleet,
    timeout: float,
    on_sample: Callable[[str, RankSample], None],
) -> None:
    """Scrape every healthy rank once (and learn ``max_model_len`` where still unknown)."""

    async def one(rank: Rank) -> None:
        if rank.max_model_len is None:
            await learn_max_model_len(client, rank, timeout)
        sample = await fetch_sample(client, rank, timeout)
        if sample is not None:
            rank.offloads_kv = sample.value("cpu_load_seconds") is not None
            on_sample(rank.name, sample)

    await asyncio.gather(*(one(r) for r in fleet.healthy()))


#: On-demand scrapes start at least this many times their own duration apart.
ON_DEMAND_SPACING = 10


async def run_metrics_polls(
    client: aiohttp.ClientSession,
    fleet: Fleet,
    interval: float,
    timeout: float,
    on_sample: Callable[[str, RankSample], None],
    sooner: asyncio.Event | None = None,
) -> None:
    """Forever: scrape every healthy rank, then sleep ``interval`` (the health checks' own) or until
    ``sooner`` is set (a caller wants fresh figures now), but never scraping more than
    ``1 / ON_DEMAND_SPACING`` of the time: however often it is asked, a scrape that took 5 ms waits
    45 ms before the next. Cancelled at shutdown."""
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        await poll_all(client, fleet, timeout, on_sample)
        if sooner is None:
            await asyncio.sleep(interval)
            continue
        spacing = min(interval, (loop.time() - started) * (ON_DEMAND_SPACING - 1))
        await asyncio.sleep(spacing)
        with contextlib.suppress(TimeoutError):  # the interval passed: the regular poll
            await asyncio.wait_for(sooner.wait(), interval - spacing)
        sooner.clear()
