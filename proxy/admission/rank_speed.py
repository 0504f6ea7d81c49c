"""How fast each rank computes prefill and how busy it is, from its own ``/metrics``
(``routing/rank_metrics.py``, polled with the health checks).

A rank's speed is the time its requests spent in prefill per prompt token it computed (prompt
tokens minus prefix-cache hits), between two scrapes far enough apart to have computed at least
``MIN_COMPUTED_TOKENS``: contention included, so a busy rank's token costs more than an idle one's,
which is what a request waiting behind it lives. Successive figures are smoothed (``SMOOTHING``).
Without ``vllm:request_prefill_time_seconds`` the time to first token minus the time queued stands
in. A rank that has not computed enough yet borrows the fleet's mean; with no rank measured the
speed is unknown (``None``): each answer while sessions wait then asks for a scrape at once
(``wanted``).

With KV offloading a rank also says how fast it loads blocks back from CPU memory: the seconds its
loads took (``vllm:kv_offload_load_time``) per token its connector loaded instead of prefilling
(``vllm:external_prefix_cache_hits``), between two scrapes that loaded at least
``MIN_LOADED_TOKENS``, smoothed alike. Those tokens are not computed: they leave the prefill
figure's tokens. ``cpu_load_costs`` gives each rank's load cost against its prefill cost, what
routing weighs a CPU-held block by (``routing.policies.bounds.tier_weighed_hit``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass

from routing.rank_metrics import RankSample

#: Prompt tokens a rank must have computed between two scrapes to measure its speed.
MIN_COMPUTED_TOKENS = 4096
#: Tokens a rank must have loaded back from CPU memory between two scrapes to measure its load speed.
MIN_LOADED_TOKENS = 4096
#: Weight of the newest measurement in the smoothed speed.
SMOOTHING = 0.3


@dataclass(frozen=True, slots=True)
class RankLoad:
    """What a rank's last scrape said: its scheduler queues and its KV cache use."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float | None = None


def _prefill_seconds(sample: RankSample) -> float | None:
    prefill = sample.histogram("prefill")
    if prefill is not None:
        return prefill.sum
    ttft, queue = sample.histogram("ttft"), sample.histogram("queue")
    if ttft is None:
        return None
    return ttft.sum - (queue.sum if queue is not None else 0.0)


def _computed_tokens(sample: RankSample) -> float | None:
    prompt = sample.value("prompt_tokens")
    if prompt is None:
        return None
    return prompt - (sample.value("cached_tokens") or 0.0) - (sample.value("cpu_loaded_tokens") or 0.0)


class RankSpeeds:
    """Per rank: smoothed seconds of prefill per computed token, and the latest load."""

    def __init__(self) -> None:
        self._base: dict[str, RankSample] = {}
        self._seconds_per_token: dict[str, float] = {}
        #: Per rank: smoothed seconds of CPU-to-GPU load per loaded token, and the scrape it is from.
        self._load_seconds_per_token: dict[str, float] = {}
        self._load_base: dict[str, RankSample] = {}
        #: Per offloading rank: its load cost against its prefill (``cpu_load_costs``), made at each
        #: scrape, the only time either speed changes, and read by every routed request.
        self._cpu_load_costs: dict[str, float] = {}
        self._load: dict[str, RankLoad] = {}
        #: Per rank: whether its last scrape carried what a speed is measured from.
        self._measurable: dict[str, bool] = {}
        #: Set when a scrape is wanted before the poller's next one (``wanted``); the poller waits
        #: on it (``routing.rank_metrics.run_metrics_polls``).
        self.sooner = asyncio.Event()

    def wanted(self) -> None:
        """A request was answered while sessions wait for room and no rank's speed is measured yet:
        ask for a scrape now, not at the next health interval, so that routing weighs the ranks'
        queued prefill by measured speeds (``bounds.token_weights``) early in a wave. An answer
        is what gives the ranks something to report; once a rank is measured nothing is asked, nor
        while every rank scraped lacks the series a speed needs (no scrape could measure one)."""
        measurable = self._measurable
        if not self._seconds_per_token and (not measurable or any(measurable.values())):
            self.sooner.set()

    def observe(self, rank: str, sample: RankSample) -> None:
        """A new scrape of ``rank`` (from the metrics poller)."""
        self._load[rank] = RankLoad(
            sample.value("waiting") or 0.0, sample.value("running") or 0.0, sample.value("kv_usage")
        )
        self._observe_loads(rank, sample)
        self._observe_prefill(rank, sample)
        self._cpu_load_costs = self._load_costs()

    def _observe_prefill(self, rank: str, sample: RankSample) -> None:
        """The prefill speed from ``sample``'s prompt, hit and prefill-time counters."""
        base = self._base.get(rank)
        seconds, computed = _prefill_seconds(sample), _computed_tokens(sample)
        self._measurable[rank] = seconds is not None and computed is not None
        if base is None or seconds is None or computed is None:
            self._base[rank] = sample
            return
        base_seconds, base_computed = _prefill_seconds(base), _computed_tokens(base)
        if base_seconds is None or base_computed is None:
            self._base[rank] = sample
            return
        d_tokens, d_seconds = computed - base_computed, seconds - base_seconds
        if d_seconds < 0 or (sample.value("prompt_tokens") or 0.0) < (base.value("prompt_tokens") or 0.0):
            self._base[rank] = sample  # the rank restarted: its counters began again
            return
        # the prompt and hit counters and the prefill times move at different moments of a
        # request's life (hits at its scheduling, the rest at its first token): wait for a span
        # long enough to hold whole requests. Computed tokens can even fall a while (hits counted
        # before their prompts): that is no restart, and the base stays (taking it for one put the
        # first speed of a wave of first turns a scrape later, 0.8 s of a compressed replay).
        if d_tokens < MIN_COMPUTED_TOKENS or d_seconds <= 0:
            return  # keep the older base until enough was computed to say something
        measured = d_seconds / d_tokens
        old = self._seconds_per_token.get(rank)
        self._seconds_per_token[rank] = measured if old is None else old + SMOOTHING * (measured - old)
        self._base[rank] = sample

    def _observe_loads(self, rank: str, sample: RankSample) -> None:
        """The CPU tier's load speed from ``sample``'s offload counters (ranks without: nothing)."""
        seconds, loaded = sample.value("cpu_load_seconds"), sample.value("cpu_loaded_tokens")
        if seconds is None or loaded is None:
            return
        base = self._load_base.get(rank)
        if base is None:
            self._load_base[rank] = sample
            return
        d_seconds = seconds - (base.value("cpu_load_seconds") or 0.0)
        d_tokens = loaded - (base.value("cpu_loaded_tokens") or 0.0)
        if d_seconds < 0 or d_tokens < 0:
            self._load_base[rank] = sample  # the rank restarted
            return
        if d_tokens < MIN_LOADED_TOKENS:
            return
        measured = d_seconds / d_tokens
        old = self._load_seconds_per_token.get(rank)
        self._load_seconds_per_token[rank] = measured if old is None else old + SMOOTHING * (measured - old)
        self._load_base[rank] = sample

    def cpu_load_costs(self) -> Mapping[str, float]:
        """Per rank whose loads and prefill are both measured: what loading a token back from CPU
        memory costs against prefilling it there (seconds per loaded token over seconds per
        computed token; the fleet's mean prefill speed for a rank not measured yet). Ranks missing
        here are weighed by routing's prior (``bounds.CPU_LOAD_COST_PRIOR``). A read-only view,
        made at each scrape."""
        return self._cpu_load_costs

    def _load_costs(self) -> dict[str, float]:
        costs: dict[str, float] = {}
        for rank, load in self._load_seconds_per_token.items():
            prefill = self.seconds_per_token(rank)
            if prefill:
                costs[rank] = load / prefill
        return costs

    def seconds_per_token(self, rank: str) -> float | None:
        """Seconds of prefill per computed token on ``rank`` (the fleet's mean while it has not
        said; None while no rank has)."""
        own = self._seconds_per_token.get(rank)
        if own is not None:
            return own
        known = self._seconds_per_token.values()
        return sum(known) / len(known) if known else None

    def measured(self) -> Mapping[str, float]:
        """Seconds of prefill per computed token of each rank measured so far (a read-only view:
        routing weighs a rank's queued prefill by it, ``bounds.token_weights``)."""
        return self._seconds_per_token

    def tokens_per_second(self, rank: str) -> float | None:
        """``rank``'s measured prefill speed (None: not measured, or too fast to measure)."""
        spt = self._seconds_per_token.get(rank)
        return 1.0 / spt if spt else None

    def load(self, rank: str) -> RankLoad:
        return self._load.get(rank, RankLoad())
