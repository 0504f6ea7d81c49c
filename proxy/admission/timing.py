"""Admission's clocks, learned from the traffic rather than fixed in seconds.

A replay compressed 100x and a fleet whose agents think for minutes need clocks 100x apart; so each
comes from what the traffic shows, and a configured value (``--session-idle-ttl``,
``--admission-wait``) overrides it:

- **When a quiet session has ended** (the idle TTL): ``release_factor`` x a long think gap of the
  population (its 95th percentile, ``ThinkGaps``): ~5 % of a session's gaps exceed twice its longest
  earlier one, so past that it has most likely ended. A session that comes back later is not lost:
  it goes back to the rank that still holds its blocks (``gate.py``).
- **How likely a quiet session is to come back** after ``t`` seconds: the gaps seen longer than
  ``t`` against the sessions seen ending (a session that ends is a gap that never closes)::

      p(t) = S(t) (1 - f) / (S(t) (1 - f) + f)

  ``S(t)``: the share of recent think gaps longer than ``t``; ``f``: the share of recent quiet spells
  that were a session's last. A session idle longer is less likely to return, so its blocks cost
  less to evict (``cost.py``); once ``p`` falls below ``P_ENDED`` it has most likely ended and a
  new session may take its room (``ended_after``).
- **How long a new session may wait for room** at most: ``WAIT_REQUESTS`` long requests' durations
  (the 90th percentile of recent requests that did not wait, arrival to last byte): long enough for
  the sessions it waits on to finish their turns and be judged ended, and no longer than a handful
  of requests take to serve. Within it, ``cost.py`` admits earlier whenever evicting costs less.
- **How many turns a session takes**: the mean of the sessions that ended (what an overflowing rank
  makes its sessions recompute, round after round, in ``cost.py``).
- **How long a session lives** (first request to last), from the sessions that ended or were
  released: a session's expected remaining life at its age, so when the sessions on a full rank will
  have ended and how soon a waiter gets room (``cost.py``).

Before enough samples, the defaults of ``config.py`` apply (300 s, 30 s) and every quiet session is
assumed to come back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from proxy.admission.config import (
    DEFAULT_IDLE_TTL_S,
    DEFAULT_WAIT_S,
    TYPICAL_GAP_QUANTILE,
    AdmissionConfig,
)
from proxy.admission.growth import PeakEstimator
from proxy.admission.think_gaps import MIN_SAMPLES, ThinkGaps
from proxy.state.sessions import Session

#: Request durations remembered (the most recent), and how many before the bound is learned.
DURATION_WINDOW = 1000
MIN_DURATIONS = 5
#: Ended sessions whose turns are remembered, and how many before their mean is used.
TURNS_WINDOW = 200
MIN_ENDED = 5
#: The request duration that bounds a wait: a long request's (its 90th percentile), this many times.
WAIT_QUANTILE = 0.9
WAIT_REQUESTS = 4.0
#: Quiet spells (returns and ends) remembered for the share that ended.
SPELL_WINDOW = 1000
#: The learned idle TTL never goes below this (seconds). Traffic of back-to-back requests teaches
#: gaps of milliseconds, and the sessions it shows would end the moment they pause (a build, a test
#: run). The floor costs a compressed replay nothing: quiet sessions give up their room by their
#: chance of coming back (``ended_after``), not by the TTL; it only keeps them counted a while.
MIN_IDLE_TTL_S = 10.0
#: A quiet session whose chance of coming back has fallen below this has most likely ended.
P_ENDED = 0.05


class LearnedTime:
    """Think gaps, session ends and request durations, and the clocks they give admission."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        #: Every session's think gaps: also the stand-in for a session that has shown few of its own.
        self.gaps = ThinkGaps()
        self._durations: deque[float] = deque(maxlen=DURATION_WINDOW)
        #: ``_durations`` sorted, until the next one comes: the wait bound and the typical request
        #: are read on every admission attempt, a duration is noted once per request.
        self._ordered: list[float] | None = None
        #: True for a quiet spell that was a session's last, False for one it came back from.
        self._spells: deque[bool] = deque(maxlen=SPELL_WINDOW)
        self._ended = 0
        self._turns: deque[int] = deque(maxlen=TURNS_WINDOW)
        #: Lifetimes in milliseconds: a lifetime only grows, like a context, so the expected final
        #: one given an age is the same conditional mean as a session's peak given its size.
        self._lifetimes = PeakEstimator(window=TURNS_WINDOW)

    # -- what the traffic shows -------------------------------------------------------------------

    def note_gap(self, gap_s: float) -> None:
        """A think gap closed, wherever it was served (read from the table every replica shares; that
        the spell closed is counted by ``note_returns``)."""
        self.gaps.add(gap_s)

    def note_returns(self, count: int) -> None:
        """``count`` quiet spells closed (sessions came back), wherever they were served."""
        for _ in range(count):
            self._spell(False)

    def note_end(self, turns: int | None = None, lifetime_s: float | None = None) -> None:
        """A session stopped counting (idle past the TTL, or ended) after ``turns`` turns and
        ``lifetime_s`` seconds from its first request to its last: a quiet spell that did not close."""
        self._spell(True)
        self.note_released(turns, lifetime_s)

    def note_released(self, turns: int | None = None, lifetime_s: float | None = None) -> None:
        """Admission released a session judged ended (its room taken): how long it lived and how many
        turns it took, but not a quiet spell known to be its last (it may still come back)."""
        if turns:
            self._turns.append(turns)
        if lifetime_s is not None and lifetime_s >= 0:
            self._lifetimes.add(round(lifetime_s * 1000))

    def note_duration(self, seconds: float) -> None:
        """A request that did not wait for admission took ``seconds`` from arrival to its last byte,
        wherever it was served (read from the shared table)."""
        if seconds >= 0:
            self._durations.append(seconds)
            self._ordered = None

    def _spell(self, ended: bool) -> None:
        spells = self._spells
        if len(spells) == spells.maxlen and spells[0]:
            self._ended -= 1
        spells.append(ended)
        self._ended += ended

    # -- the clocks -------------------------------------------------------------------------------

    def typical_gap(self) -> float | None:
        """A long think gap across sessions (their 95th percentile), once enough are known."""
        return self.gaps.quantile(TYPICAL_GAP_QUANTILE)

    def learned(self) -> bool:
        """Whether the idle TTL comes from the traffic (or the configuration), not the default."""
        return self.config.idle_ttl is not None or self.typical_gap() is not None

    def turns_per_session(self) -> float:
        """How many turns a session takes (the mean of recently ended ones; 1 before enough ended)."""
        if len(self._turns) < MIN_ENDED:
            return 1.0
        return sum(self._turns) / len(self._turns)

    def lifetimes_known(self) -> bool:
        """Whether enough sessions ended or were released to say how long sessions live."""
        return len(self._lifetimes) >= MIN_ENDED

    def remaining_life(self, age_s: float) -> float | None:
        """Seconds a session ``age_s`` old has left to live: the mean of ``l - age_s`` over the recent
        lifetimes ``l`` at least as long (a session that has lived long is one of the long-lived ones,
        not one about to end); 0 when none lived as long; None before ``MIN_ENDED``."""
        if len(self._lifetimes) < MIN_ENDED:
            return None
        age_ms = round(age_s * 1000)
        return (self._lifetimes.expected_peak(age_ms) - age_ms) / 1000

    def outlived(self, age_s: float) -> bool:
        """Whether a session ``age_s`` old has lived longer than every recorded lifetime (once they are
        known). Its end is then unknown, not due: early in the traffic only the short sessions have
        ended yet (the long ones are the sessions still running), and taking the oldest for about to
        end predicted room that never came, so new sessions waited for it and then went past the
        budget anyway (the slow, heavy cell of ``prefixgate bench --preset matrix``)."""
        return self.lifetimes_known() and self._lifetimes.reaching(round(age_s * 1000)) == 0

    def idle_ttl(self) -> float:
        """Seconds after its last request a session has ended: configured, else learned."""
        if self.config.idle_ttl is not None:
            return self.config.idle_ttl
        typical = self.typical_gap()
        if typical is None:
            return DEFAULT_IDLE_TTL_S
        return max(MIN_IDLE_TTL_S, self.config.release_factor * typical)

    def wait_bound(self) -> float:
        """Seconds a new session may wait for room: configured, else ``WAIT_REQUESTS`` long requests'
        durations."""
        if self.config.wait is not None:
            return self.config.wait
        if len(self._durations) < MIN_DURATIONS:
            return DEFAULT_WAIT_S
        ordered = self._sorted_durations()
        return WAIT_REQUESTS * ordered[min(len(ordered) - 1, int(WAIT_QUANTILE * len(ordered)))]

    def request_seconds(self) -> float | None:
        """A typical request's duration (the median of recent ones), once enough are known."""
        if len(self._durations) < MIN_DURATIONS:
            return None
        ordered = self._sorted_durations()
        return ordered[len(ordered) // 2]

    def _sorted_durations(self) -> list[float]:
        if self._ordered is None:
            self._ordered = sorted(self._durations)
        return self._ordered

    def ended_share(self) -> float | None:
        """The share of recent quiet spells that were a session's last (None before ``MIN_SAMPLES``)."""
        if len(self._spells) < MIN_SAMPLES:
            return None
        return self._ended / len(self._spells)

    def quiet_ended(self) -> float | None:
        """Quiet seconds after which a session has most likely ended: where its chance of coming back
        falls below ``P_ENDED`` (the gaps' quantile where ``p(t) = P_ENDED``); None while the traffic
        has not said enough."""
        ended = self.ended_share()
        if ended is None or ended >= 1.0:
            return None
        longer = P_ENDED * ended / ((1.0 - P_ENDED) * (1.0 - ended))  # S(t) where p(t) = P_ENDED
        return self.gaps.quantile(max(0.0, 1.0 - longer))

    def ended_after(self, session: Session) -> float | None:
        """``quiet_ended`` for ``session``: at least its own longest gap, at most the idle TTL."""
        quiet = self.quiet_ended()
        return None if quiet is None else _ended_after(quiet, self.idle_ttl(), session)

    def release_rule(self) -> Callable[[Session], float]:
        """Quiet seconds after its last answer from which a session has most likely ended
        (``Ledger.release_after``), with what the traffic taught read once: for a pass over many
        sessions (reading the gaps' quantiles per session was a third of a count's time). For the
        ``cost`` policy, once the traffic says enough, ``ended_after``; else
        ``AdmissionConfig.release_after``'s think-gap rule."""
        idle_ttl = self.idle_ttl()
        if self.config.policy == "cost":
            quiet = self.quiet_ended()
            if quiet is not None:
                return lambda session: _ended_after(quiet, idle_ttl, session)
        config, typical = self.config, self.typical_gap()
        return lambda session: config.release_after(session, typical, idle_ttl)

    def return_probability(self, idle_s: float) -> float:
        """How likely a session quiet for ``idle_s`` seconds is to send another request (see the
        module docstring); 1 while the traffic has not said enough."""
        longer = self.gaps.longer_than(idle_s)
        ended = self.ended_share()
        if longer is None or ended is None:
            return 1.0
        returning = longer * (1.0 - ended)
        total = returning + ended
        return returning / total if total > 0 else 0.0


def _ended_after(quiet: float, idle_ttl: float, session: Session) -> float:
    """``quiet`` seconds (the population's), at least ``session``'s own longest gap, at most the TTL."""
    return min(idle_ttl, max(quiet, session.gap_max))
