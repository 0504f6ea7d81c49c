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
- Judged returns are taken ``WINDOW`` at a time. The first lost one of a window cuts the rank's share
  to ``CUT`` of itself at once (not below ``MIN_FRACTION``); so does a preemption the rank reports
  (``vllm:num_preemptions_total`` grew between two scrapes: its running sequences outgrew the pool).
  One cut a window: the cut takes no seat back, so the losses that follow it at once are the same
  crowding, and cutting for each would take the share to its floor.
- A window with no loss or preemption grows the share by ``STEP`` (not past ``MAX_FRACTION``) if any
  of its returns found sessions waiting for a seat while the rank's own scheduler queue was empty at
  its last scrape. Room nobody asked for teaches nothing about what the pool holds, and a rank whose
  own queue is full would run no faster with more sessions.

Additive increase and multiplicative decrease, as TCP's congestion window: the share settles just
under the point where seated sessions start to evict each other, and backs off quickly when the
traffic's sessions grow. A cut takes no seat back: sessions seated past the new budget keep theirs,
and the next session waits. It counts answers, not seconds, so a replay compressed 100x learns as
fast in its own time.

``--target-fraction`` fixes every rank's share instead; unset, each starts from
``DEFAULT_TARGET_FRACTION``. Each replica learns from the answers it relays.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from proxy.config import DEFAULT_TARGET_FRACTION
from proxy.context import Expectation

log = logging.getLogger("prefixgate.admission")

#: Judged returns on a rank a window holds: at most one cut, or one step of growth, a window.
WINDOW = 8
#: What a window adds to a share when no seated session lost blocks while others waited.
STEP = 0.05
#: What a share keeps of itself when a seated session lost blocks or the rank preempted.
CUT = 0.8
#: The bounds of a learned share (of the projected peaks the pool holds).
MIN_FRACTION = 0.4
MAX_FRACTION = 2.0


@dataclass(slots=True)
class RankShare:
    """One rank's learned share and the judged returns since it last changed."""

    rank: str
    fraction: float
    #: Judged returns of the current window.
    judged: int = 0
    #: Of those, the ones that found sessions waiting for a seat while the rank's own queue was empty.
    wanted: int = 0
    #: The window has cut the share (a loss or a preemption): it cuts no more and does not grow it.
    cut: bool = False


class LearnedBudget:
    """Each rank's share of its KV cache that seats may fill (see the module docstring)."""

    def __init__(self, fixed: float | None = None) -> None:
        """``fixed``: every rank's share, never learned (``--target-fraction``); None: each rank's
        starts at ``DEFAULT_TARGET_FRACTION`` and is learned."""
        self.start = fixed if fixed is not None else DEFAULT_TARGET_FRACTION
        self.fixed = fixed is not None
        self._shares: dict[str, RankShare] = {}
        #: Each rank's preemption counter at its last scrape.
        self._preemptions: dict[str, float] = {}

    def fraction(self, rank: str) -> float:
        """``rank``'s share of its KV cache that seats may fill (a read)."""
        share = self._shares.get(rank)
        return share.fraction if share is not None else self.start

    def preempted(self, rank: str, preemptions: float | None) -> None:
        """``rank``'s scrape counted ``preemptions`` so far: any since the last scrape cut its share."""
        if preemptions is None:
            return
        last = self._preemptions.get(rank)
        self._preemptions[rank] = preemptions
        if last is not None and preemptions > last and not self.fixed:
            self._cut(self._share(rank), f"it preempted {preemptions - last:.0f} running requests")

    def judge(
        self, rank: str, expected: Expectation | None, prompt_tokens: int, cached: int | None, wanted: bool
    ) -> None:
        """A seated session's turn on ``rank`` was answered with ``cached`` of its ``prompt_tokens``
        cached; ``wanted``: sessions were waiting for a seat while the rank's own queue was empty.
        Only a return that extends its previous turn on the same rank, counted the same way by the
        rank, is judged."""
        if self.fixed or expected is None or cached is None or expected.expected_tokens <= 0:
            return
        if expected.rank != rank or expected.previous_rank != rank or prompt_tokens != expected.num_tokens:
            return
        share = self._share(rank)
        if cached < expected.expected_tokens:
            self._cut(share, f"a seated session lost {expected.expected_tokens - cached} cached tokens")
        share.judged += 1
        share.wanted += wanted
        if share.judged < WINDOW:
            return
        if not share.cut and share.wanted:
            before, share.fraction = share.fraction, min(MAX_FRACTION, share.fraction + STEP)
            if share.fraction != before:
                log.info(
                    "%s's budget share %.2f -> %.2f of its cache: %d seated sessions' returns kept their "
                    "blocks while others waited",
                    rank,
                    before,
                    share.fraction,
                    share.judged,
                )
        share.judged = share.wanted = 0
        share.cut = False

    def _share(self, rank: str) -> RankShare:
        share = self._shares.get(rank)
        if share is None:
            share = self._shares[rank] = RankShare(rank, self.start)
        return share

    def _cut(self, share: RankShare, why: str) -> None:
        """Cut ``share`` for ``why``, unless its window has cut it already."""
        if share.cut:
            return
        share.cut = True
        before, share.fraction = share.fraction, max(MIN_FRACTION, share.fraction * CUT)
        if share.fraction != before:
            log.info(
                "%s's budget share %.2f -> %.2f of its cache: %s", share.rank, before, share.fraction, why
            )
