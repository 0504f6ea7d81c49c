"""Admission's settings (the rule that judges a quiet session ended is ``learned.release_after``)."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.config import DEFAULT_IDLE_TTL_S, DEFAULT_TARGET_FRACTION, DEFAULT_WAIT_S

#: A session quiet for longer than this many times its longest think gap so far has most likely ended:
#: in those traces a session's next gap exceeds twice its longest earlier gap for ~5 % of gaps.
DEFAULT_RELEASE_FACTOR = 2.0
#: ... but never sooner than this fraction of the idle TTL (30 s for the default 300 s).
DEFAULT_RELEASE_MIN_FRACTION = 0.1
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
    #: Seconds after which a quiet session has ended; None: learned from the think gaps (``learned``).
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
