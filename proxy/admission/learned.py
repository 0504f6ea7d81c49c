"""What admission learns from the traffic and from the ranks: how long agents think, how long requests
take, how large sessions grow before they end, and how fast each rank computes prefill.

A replay compressed 100x and a fleet whose agents think for minutes need clocks 100x apart; so each
comes from what the traffic shows, and a configured value (``--session-idle-ttl``,
``--admission-wait``) overrides it:

- **When a quiet session has ended** (the idle TTL): ``release_factor`` x a long think gap of the
  population (its 95th percentile, ``ThinkGaps``): ~5 % of a session's gaps exceed twice its longest
  earlier one, so past that it has most likely ended. A session quiet past its own think times
  (``release_after``) gives up its seat sooner when another needs it.
- **The rotation bound**, how long a session waits for a seat before quiet residents are parked for
  it: ``WAIT_REQUESTS`` long requests' durations (the 90th percentile of recent requests that did
  not wait, arrival to last byte): a seat rotates after a few turns' time, however fast the ranks
  and however compressed the replay.

Before enough samples, the defaults of ``config.py`` apply (300 s, 30 s).

**How far sessions grow** (``PeakEstimator``). An agent session's context grows turn after turn (a
Claude Code conversation from its ~15k-token system prompt and tools to tens of thousands of tokens),
so the room a session needs on its rank is not its prompt at admission but what it will hold by its
last turn. Admission reserves, per active session, the expected peak of a session that already holds
``c`` tokens: the mean of the peaks of recently ended sessions that reached at least ``c`` (a session
never shrinks, so only those are comparable). With no such session on record it reserves ``c``
itself: no growth is assumed until some has been seen (admission re-homes a session when a rank
outgrows its pool anyway), and a session larger than any seen so far is reserved as large as it is.

**How fast each rank computes prefill** and how busy it is (``RankSpeeds``), from its own ``/metrics``
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
import bisect
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from proxy.admission.config import AdmissionConfig
from proxy.config import DEFAULT_IDLE_TTL_S, DEFAULT_WAIT_S
from proxy.state.sessions import Session
from routing.rank_metrics import RankSample
from routing.samples import RecentSamples

#: A session with at least this many think gaps of its own is judged by them alone; one with fewer
#: (a single short gap, or none for a one-request session) by the population's (``ThinkGaps``).
OWN_EVIDENCE = 3
#: The population's think gap that stands in for a session's own: the 95th percentile.
TYPICAL_GAP_QUANTILE = 0.95
#: Request durations remembered (the most recent), and how many before the bound is learned.
DURATION_WINDOW = 1000
MIN_DURATIONS = 5
#: The request duration that bounds a wait: a long request's (its 90th percentile), this many times.
WAIT_QUANTILE = 0.9
WAIT_REQUESTS = 4.0
#: The learned idle TTL never goes below this (seconds). Traffic of back-to-back requests teaches
#: gaps of milliseconds, and the sessions it shows would end the moment they pause (a build, a test
#: run). It only keeps a quiet session's record counted a while: a quiet session gives up its seat
#: by its own think times when one is needed (``release_rule``), which this floor does not hold back,
#: or a replay compressed 100x would keep ended sessions seated 100x too long.
MIN_IDLE_TTL_S = 10.0


class ThinkGaps(RecentSamples):
    """Recent think gaps of all sessions (seconds), how long agents usually stay quiet between an
    answer and their next request: ``quantile`` is a typical agent's long pause
    (``routing.samples``), what stands in for the gaps of a session that has shown too few of its own
    (``OWN_EVIDENCE``)."""


def release_after(
    config: AdmissionConfig, session: Session, typical_gap: float | None = None, idle_ttl: float | None = None
) -> float:
    """Seconds after its last answer from which ``session`` counts as ended when room is needed.

    ``typical_gap``: a long think gap of the population (``ThinkGaps``), which stands in for the
    session's own while it has fewer than ``OWN_EVIDENCE`` gaps: with none it would hold its room
    for the whole idle TTL, with one short gap it would count as ended after twice that.
    ``idle_ttl``: the TTL in force (learned, when the configuration leaves it open).
    """
    ttl = idle_ttl if idle_ttl is not None else config.idle_ttl
    if ttl is None:
        ttl = DEFAULT_IDLE_TTL_S
    if typical_gap is not None and session.gaps < OWN_EVIDENCE:
        estimate = max(session.gap_max, typical_gap)
    elif session.gaps:
        estimate = session.gap_max
    else:
        return ttl  # no think time seen yet: nothing to judge by
    floor = ttl * config.release_min_fraction
    return min(ttl, max(floor, config.release_factor * estimate))


def poll_interval(idle_ttl: float) -> float:
    """How often a queued request re-checks: sessions idle out with time, other replicas change."""
    return min(0.25, max(idle_ttl / 10, 0.01))


class LearnedTime:
    """Think gaps and request durations, and the clocks they give admission."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        #: Every session's think gaps: also the stand-in for a session that has shown few of its own.
        self.gaps = ThinkGaps()
        self._durations: deque[float] = deque(maxlen=DURATION_WINDOW)
        #: ``_durations`` sorted, until the next one comes: the bound is read on every attempt, a
        #: duration is noted once per request.
        self._ordered: list[float] | None = None

    def note_gap(self, gap_s: float) -> None:
        """A think gap closed, wherever it was served (read from the table every replica shares)."""
        self.gaps.add(gap_s)

    def note_duration(self, seconds: float) -> None:
        """A request that did not wait for admission took ``seconds`` from arrival to its last byte,
        wherever it was served (read from the shared table)."""
        if seconds >= 0:
            self._durations.append(seconds)
            self._ordered = None

    def typical_gap(self) -> float | None:
        """A long think gap across sessions (their 95th percentile), once enough are known."""
        return self.gaps.quantile(TYPICAL_GAP_QUANTILE)

    def learned(self) -> bool:
        """Whether the idle TTL comes from the traffic (or the configuration), not the default."""
        return self.config.idle_ttl is not None or self.typical_gap() is not None

    def idle_ttl(self) -> float:
        """Seconds after its last request a session has ended: configured, else learned."""
        if self.config.idle_ttl is not None:
            return self.config.idle_ttl
        typical = self.typical_gap()
        if typical is None:
            return DEFAULT_IDLE_TTL_S
        return max(MIN_IDLE_TTL_S, self.config.release_factor * typical)

    def wait_bound(self) -> float:
        """Seconds a session waits for a seat before one rotates to it: configured, else
        ``WAIT_REQUESTS`` long requests' durations."""
        if self.config.wait is not None:
            return self.config.wait
        if len(self._durations) < MIN_DURATIONS:
            return DEFAULT_WAIT_S
        ordered = self._ordered
        if ordered is None:
            ordered = self._ordered = sorted(self._durations)
        return WAIT_REQUESTS * ordered[min(len(ordered) - 1, int(WAIT_QUANTILE * len(ordered)))]

    def release_rule(self) -> Callable[[Session], float]:
        """Quiet seconds after its last answer from which a session has most likely ended
        (``release_after``), with what the traffic taught read once: for a pass over
        many sessions (reading the gaps' quantiles per session was a third of a count's time)."""
        config, typical = self.config, self.typical_gap()
        idle_ttl = self.idle_ttl()
        if config.idle_ttl is None and typical is not None:
            idle_ttl = config.release_factor * typical  # the learned TTL before its floor
        return lambda session: release_after(config, session, typical, idle_ttl)


#: Ended sessions remembered (the most recent): a bound on memory, and the estimate follows the
#: current traffic rather than all of history.
PEAK_WINDOW = 1000


class PeakEstimator:
    """Peak context tokens of recently ended sessions, and the expected peak given a current size."""

    def __init__(self, window: int = PEAK_WINDOW) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: list[int] = []
        #: ``_above[i]`` = sum of ``_sorted[i:]``; one more entry (0) past the end.
        self._above: list[int] = [0]

    def __len__(self) -> int:
        return len(self._recent)

    def add(self, peak_tokens: int) -> None:
        """Record the largest context an ended session held (sessions end far less often than
        admission asks, so the sums are rebuilt here rather than per query)."""
        recent = self._recent
        if len(recent) == recent.maxlen:
            old = recent[0]
            del self._sorted[bisect.bisect_left(self._sorted, old)]
        recent.append(peak_tokens)
        bisect.insort(self._sorted, peak_tokens)
        above = [0] * (len(self._sorted) + 1)
        for i in range(len(self._sorted) - 1, -1, -1):
            above[i] = above[i + 1] + self._sorted[i]
        self._above = above

    def expected_peak(self, tokens: int) -> int:
        """The mean peak of the recorded sessions that reached ``tokens``; ``tokens`` when none did."""
        first = bisect.bisect_left(self._sorted, tokens)
        count = len(self._sorted) - first
        if count == 0:
            return tokens
        return max(tokens, -(-self._above[first] // count))


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
