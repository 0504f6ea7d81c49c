"""How much of each rank's KV cache its seats may fill: learned from whether seated sessions keep
their blocks.

The budget counts each seated session at its projected peak (``growth.py``), and a session spends
most of its life below its peak, so a fixed share of the pool is wrong in one direction or the other:
too low, sessions wait while the pool could hold them; too high, seated sessions evict each other.
Which depends on the traffic and the rank (how far sessions run below their peaks, how many sequences
the rank runs at once, its block size), so each rank's share is learned from what the budget exists
to protect:

- A *judged return* is an answered turn of a seated session (not admitted anew: not new, parked or
  ended since its last turn) on the rank its previous turn went to, whose prompt shares a prefix with
  that turn's (the prefix-break explainer's ``Expectation``). It *kept* its blocks when the rank
  reported at least that prefix cached (every tier: a block offloaded to CPU memory is kept), and
  *lost* them otherwise: the rank's cache evicted a seated session's blocks.
- After every ``WINDOW`` judged returns on a rank: one lost, and the share is cut to ``CUT`` of itself
  (not below ``MIN_FRACTION``); none lost while sessions waited for a seat, and it grows by ``STEP``
  (not past ``MAX_FRACTION``); none lost and nobody waiting, it stays (room nobody asked for teaches
  nothing about what the pool holds).

Additive increase and multiplicative decrease, as TCP's congestion window: the share settles just
under the point where seated sessions start to evict each other, and backs off quickly when the
traffic's sessions grow. A cut takes no seat back: sessions seated past the new budget keep theirs,
and the next session waits. It counts answers, not seconds, so a replay compressed 100x learns as
fast in its own time.

``--target-fraction`` fixes every rank's share instead; unset, each starts from
``DEFAULT_TARGET_FRACTION``. Each replica learns from the answers it relays.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.config import DEFAULT_TARGET_FRACTION
from proxy.context import Expectation

#: Judged returns on a rank between two decisions on its share.
WINDOW = 8
#: What a decision adds to a share when no seated session lost blocks while others waited.
STEP = 0.05
#: What a share keeps of itself when a seated session lost blocks.
CUT = 0.8
#: The bounds of a learned share (of the projected peaks the pool holds).
MIN_FRACTION = 0.4
MAX_FRACTION = 2.0


@dataclass(slots=True)
class RankShare:
    """One rank's learned share and the judged returns since its last decision."""

    fraction: float
    judged: int = 0
    lost: int = 0
    #: Judged returns of this window that found sessions waiting for a seat.
    wanted: int = 0


class LearnedBudget:
    """Each rank's share of its KV cache that seats may fill (see the module docstring)."""

    def __init__(self, fixed: float | None = None) -> None:
        """``fixed``: every rank's share, never learned (``--target-fraction``); None: each rank's
        starts at ``DEFAULT_TARGET_FRACTION`` and is learned."""
        self.start = fixed if fixed is not None else DEFAULT_TARGET_FRACTION
        self.fixed = fixed is not None
        self._shares: dict[str, RankShare] = {}

    def fraction(self, rank: str) -> float:
        """``rank``'s share of its KV cache that seats may fill (a read)."""
        share = self._shares.get(rank)
        return share.fraction if share is not None else self.start

    def fractions(self) -> dict[str, float]:
        """Every rank's learned share (ranks not yet judged use ``start``)."""
        return {name: share.fraction for name, share in self._shares.items()}

    def judge(
        self, rank: str, expected: Expectation | None, prompt_tokens: int, cached: int | None, waiting: bool
    ) -> None:
        """A seated session's turn on ``rank`` was answered with ``cached`` of its ``prompt_tokens``
        cached; ``waiting``: sessions were waiting for a seat. Only a return that extends its previous
        turn on the same rank, counted the same way by the rank, is judged."""
        if self.fixed or expected is None or cached is None or expected.expected_tokens <= 0:
            return
        if expected.rank != rank or expected.previous_rank != rank or prompt_tokens != expected.num_tokens:
            return
        share = self._shares.get(rank)
        if share is None:
            share = self._shares[rank] = RankShare(self.start)
        share.judged += 1
        share.lost += cached < expected.expected_tokens
        share.wanted += waiting
        if share.judged < WINDOW:
            return
        if share.lost:
            share.fraction = max(MIN_FRACTION, share.fraction * CUT)
        elif share.wanted:
            share.fraction = min(MAX_FRACTION, share.fraction + STEP)
        share.judged = share.lost = share.wanted = 0
