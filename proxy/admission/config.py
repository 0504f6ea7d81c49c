"""Admission's settings and the rule that judges a quiet session ended."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.config import DEFAULT_IDLE_TTL_S, DEFAULT_WAIT_S
from proxy.state.sessions import Session

DEFAULT_TARGET_FRACTION = 0.8
#: A session quiet for longer than this many times its longest think gap so far has most likely ended:
#: in those traces a session's next gap exceeds twice its longest earlier gap for ~5 % of gaps.
DEFAULT_RELEASE_FACTOR = 2.0
#: ... but never sooner than this fraction of the idle TTL (30 s for the default 300 s).
DEFAULT_RELEASE_MIN_FRACTION = 0.1
#: A session with at least this many think gaps of its own is judged by them alone; one with fewer
#: (a single short gap, or none for a one-request session) by the population's (``timing.ThinkGaps``).
OWN_EVIDENCE = 3
#: The population's think gap that stands in for a session's own: the 95th percentile.
TYPICAL_GAP_QUANTILE = 0.95
#: A reservation not routed within this many seconds (its request failed early) is dropped.
RESERVATION_TTL_S = 30.0
#: Without a token count (policies that skip the blocks stage) a prompt is estimated from its body.
BYTES_PER_TOKEN = 4

#: Sessions waiting for a seat, per replica, past which a new one is answered 429 (Retry-After).
DEFAULT_MAX_QUEUE = 1024


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    enabled: bool = True
    target_fraction: float = DEFAULT_TARGET_FRACTION
    #: Seconds after which a quiet session has ended; None: learned from the think gaps (``timing``).
    idle_ttl: float | None = DEFAULT_IDLE_TTL_S
    #: Seconds a session waits for a seat before one rotates to it; None: learned from request
    #: durations.
    wait: float | None = DEFAULT_WAIT_S
    max_sessions_per_rank: int | None = None
    block_size: int = 16
    release_factor: float = DEFAULT_RELEASE_FACTOR
    #: Fraction of ``idle_ttl``: the least idle time after which a session can be reclaimed.
    release_min_fraction: float = DEFAULT_RELEASE_MIN_FRACTION
    #: Sessions waiting for a seat past which a new one is refused (None: no limit).
    max_queue: int | None = DEFAULT_MAX_QUEUE

    def release_after(
        self, session: Session, typical_gap: float | None = None, idle_ttl: float | None = None
    ) -> float:
        """Seconds after its last answer from which ``session`` counts as ended when room is needed.

        ``typical_gap``: a long think gap of the population (``ThinkGaps``), which stands in for the
        session's own while it has fewer than ``OWN_EVIDENCE`` gaps: with none it would hold its room
        for the whole idle TTL, with one short gap it would count as ended after twice that.
        ``idle_ttl``: the TTL in force (learned, when the configuration leaves it open).
        """
        ttl = idle_ttl if idle_ttl is not None else self.idle_ttl
        if ttl is None:
            ttl = DEFAULT_IDLE_TTL_S
        if typical_gap is not None and session.gaps < OWN_EVIDENCE:
            estimate = max(session.gap_max, typical_gap)
        elif session.gaps:
            estimate = session.gap_max
        else:
            return ttl  # no think time seen yet: nothing to judge by
        floor = ttl * self.release_min_fraction
        return min(ttl, max(floor, self.release_factor * estimate))

    def poll_interval(self, idle_ttl: float) -> float:
        """How often a queued request re-checks: sessions idle out with time, other replicas change."""
        return min(0.25, max(idle_ttl / 10, 0.01))
