"""The ``cost`` admission policy: admit a new session where it costs least, or wait when waiting costs
less. Pure functions over a count (``accounting.count``) and what the ranks measured.

For a new session (or one back after ending, whose blocks are gone), each candidate rank is an
``Option`` whose delay is estimated in prompt tokens to compute, at that rank's measured seconds per
token (``rank_speed.py``):

- its own miss: the prompt minus what the rank already holds of it (its shared head, or its earlier
  turns per the prefix index);
- the prefill already queued there (routed by prefixgate, not yet answered);
- the blocks of other sessions it would push out of the budget: the rank evicts the least recently
  answered first, and each evicted session recomputes them only if it comes back, so each counts
  weighted by ``p(idle)``, the chance a session quiet that long returns (``timing.py``): a session
  idle long (likely ended) costs little, one in flight costs all;
- and, when the sessions likely to come back (each weighted by ``p``) no longer fit the rank's pool
  with it, the overflow the pool cannot hold: it is recomputed again at every round of their turns
  (the rank evicts the tails of the least recently used, who evict the next ones when they come
  back), for as many rounds as a session usually has left (``timing.py``).

Then (``choose``): a rank with room as is, or once sessions judged ended are released, takes the
session at once (with any rank that costs less than the best of those). With no room anywhere,
room comes when a session large enough to make it ends: each session on a rank that would free
the shortfall there ends with its chance of not coming back (``1 - p`` for a quiet one, the share
of turns that are a session's last for one in flight) at the time it is judged ended. Over the
wait bound ``B`` that gives the chance ``P`` that room comes within it and the expected time spent
waiting ``W = E[min(T, B)]``; waiting costs ``W`` plus, when room does not come, the evictions
anyway, so the session waits only while::

    W < P x (the least costly rank's eviction delay)

(once the last departure has passed without room, it stops waiting: the decision is taken again at
every change). Once sessions' lifetimes are learned (``timing.py``), room is predicted instead from
when each session on the rank will have ended (its remaining life at its age, then quiet long
enough to be judged ended), freed by several of them one after another (``room_at``): ``P`` is 1
when that is within the bound, else 0. A session older than every one seen to end has no known end
(``LearnedTime.outlived``) and promises no room. A wait whose room did not come by the time it
first expected it stops (``overdue``): a prediction that keeps moving is not followed to the bound.

When the ranks compute fast, evicting costs little and the session goes in at once; when they are
compute-bound, the budget holds while room is likely to come. Past the bound it is admitted on the
least costly rank in any case: a session that can run is never refused for lack of room.

Whatever the waiting spares the others, the session never waits longer than admitting it at once
would delay its own first token (``Option.start_s``: the prefill queued on the least costly ranks,
then its own, at their measured speed): past that, it has lost more to the wait than the thrash would
have cost it, and it goes in on the least costly ranks. So it waits seconds where the ranks are
compute-bound and their queues long, and hardly at all where they have compute to spare; room it
expects later than that does not hold it either. Until the ranks' speeds are measured (a scrape
after the first answers), a typical request's duration (``LearnedTime.request_seconds``) stands in
for that delay, and before even that is known the budget holds up to the bound. Until the clocks are
learned (the first think gaps), the budget holds for no longer than that delay.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from proxy.admission.accounting import RankState
from proxy.admission.room import Room
from proxy.state.sessions import Session

#: Past the budgets, ranks whose cost is within this factor of the least costly are offered to the
#: router too: it spreads the load among them (one rank taking every over-budget session would
#: queue their prefills behind each other).
TIE_FACTOR = 2.0
#: A rank is saturated when its queued prefill would take this many wait bounds to compute and it
#: reports requests waiting; every rank saturated is real overload (a 429 with Retry-After).
SATURATED_WAITS = 8.0


@dataclass(frozen=True, slots=True)
class Candidate:
    """What is known of one rank for a new session: its count, what it holds of the session's
    prompt, the prefill queued on it and its measured speed."""

    state: RankState
    hit_tokens: int
    queued_prefill_tokens: int
    seconds_per_token: float | None
    waiting_requests: float = 0.0


@dataclass(frozen=True, slots=True)
class Option:
    """Admitting the session on ``rank`` now: what it would cost."""

    rank: str
    own_prefill_tokens: int
    queued_prefill_tokens: int
    #: Tokens of other sessions it would push past the rank's budget, and the share expected to be
    #: recomputed (each weighted by its chance of coming back).
    evicted_tokens: int
    expected_recompute_tokens: float
    seconds_per_token: float | None
    #: When room may come here: (seconds from now, chance) per session that would free the shortfall
    #: by ending, at the time it would be judged ended.
    departures: tuple[tuple[float, float], ...] = ()
    waiting_requests: float = 0.0
    #: Once sessions' lifetimes are learned: seconds until enough of its sessions will have ended to
    #: free the shortfall (None: not even all of them would, or lifetimes not learned).
    room_at_s: float | None = None

    @property
    def room_in_s(self) -> float | None:
        """The soonest room may come here (None: no session's end is known to make it)."""
        if self.room_at_s is not None:
            return self.room_at_s
        return min((at for at, _ in self.departures), default=None)

    @property
    def cost_tokens(self) -> float:
        return self.own_prefill_tokens + self.queued_prefill_tokens + self.expected_recompute_tokens

    @property
    def cost_s(self) -> float | None:
        spt = self.seconds_per_token
        return self.cost_tokens * spt if spt is not None else None

    @property
    def eviction_s(self) -> float | None:
        """The delay the evictions cause the sessions that come back."""
        spt = self.seconds_per_token
        return self.expected_recompute_tokens * spt if spt is not None else None

    @property
    def queue_s(self) -> float | None:
        spt = self.seconds_per_token
        return self.queued_prefill_tokens * spt if spt is not None else None

    @property
    def start_s(self) -> float | None:
        """How long its first token would wait if it were admitted here now: the prefill queued here,
        then its own."""
        spt = self.seconds_per_token
        return (self.queued_prefill_tokens + self.own_prefill_tokens) * spt if spt is not None else None


@dataclass(frozen=True, slots=True)
class Choice:
    """Admission's decision for a new session at one moment."""

    admit: bool
    #: ``room`` (fits as is, or once ended sessions go), ``over_budget`` (evicting costs less than
    #: waiting, or no room is coming in time), ``after_wait`` (the wait bound passed), ``wait``.
    decision: str
    allowed: frozenset[str]
    victims: dict[str, tuple[str, ...]]
    options: tuple[Option, ...]
    #: Over the wait bound: the expected seconds spent waiting, and the chance room comes.
    wait_s: float | None
    room_chance: float
    reason: str
    #: Ranks ``allowed`` past their budgets beside ranks with room, where admitting costs less: room
    #: is taken there without a budget check (the shared claims too, so replicas decide as one).
    past_budget: frozenset[str] = frozenset()

    @property
    def room_in_s(self) -> float | None:
        return self.wait_s


def option(
    candidate: Candidate,
    prompt_tokens: int,
    need: int,
    now: float,
    return_probability: Callable[[float], float],
    ends_at: Callable[[Session], float],
    rounds: float = 1.0,
    last_turn: float = 0.0,
    expected_end: Callable[[Session], float] | None = None,
) -> Option:
    """The cost of admitting on ``candidate``'s rank a session of ``prompt_tokens`` that needs
    ``need`` projected tokens of room there (its share not held yet), for ``rounds`` turns;
    ``last_turn``: the chance a turn in flight is its session's last; ``expected_end``: when a
    session will have ended, once lifetimes are learned (``room_at``)."""
    state = candidate.state
    budget = state.budget_tokens
    over = 0 if budget is None else state.projected_tokens + state.reserved_tokens + need - budget
    room_at_s = room_at(state, over, now, expected_end) if expected_end is not None else None
    short = over
    evicted = 0
    expected = 0.0
    # the sessions likely to come back, each weighted by its chance: what the pool must keep holding
    live = float(state.projected_tokens + state.reserved_tokens + need)
    departures: list[tuple[float, float]] = []
    for session, freed in state.lru:
        chance = return_probability(now - session.answered_at) if session.answered else 1.0
        live -= (1.0 - chance) * freed
        if freed >= short > 0:
            leaves = 1.0 - chance if session.answered else last_turn
            if leaves > 0:
                departures.append((max(ends_at(session) - now, 0.0), leaves))
        if over <= 0:
            continue
        take = min(freed, over)
        evicted += take
        expected += chance * take
        over -= take
    if over > 0:  # held by reservations and new arrivals: nothing known frees it
        evicted += over
        expected += over
    if state.pool_tokens is not None and live > state.pool_tokens:
        expected += (live - state.pool_tokens) * max(rounds - 1.0, 0.0)
    return Option(
        state.name,
        max(prompt_tokens - candidate.hit_tokens, 0),
        candidate.queued_prefill_tokens,
        evicted,
        expected,
        candidate.seconds_per_token,
        tuple(sorted(departures)),
        candidate.waiting_requests,
        room_at_s,
    )


def room_at(
    state: RankState, short: int, now: float, expected_end: Callable[[Session], float]
) -> float | None:
    """Seconds until the sessions on ``state``'s rank that will have ended by then free ``short``
    projected tokens: room comes from several sessions ending, one after another, not only from one
    large enough on its own (None: not even all of them would free it)."""
    if short <= 0:
        return 0.0
    freed = 0
    for at, tokens in sorted((expected_end(session), tokens) for session, tokens in state.lru):
        freed += tokens
        if freed >= short:  # an end never known (``math.inf``) makes no room either
            return max(at - now, 0.0) if math.isfinite(at) else None
    return None


def room_odds(options: Sequence[Option], horizon_s: float) -> tuple[float, float]:
    """(expected seconds spent waiting for room within ``horizon_s``, the chance room comes in it):
    room comes at the first departure that happens, on any rank; once the last one has passed
    without it, the session stops waiting (the decision is taken again as things change)."""
    departures = sorted(d for o in options for d in o.departures if d[0] <= horizon_s)
    waited = 0.0
    still = 1.0  # the chance no room has come yet
    last = 0.0
    for at, leaves in departures:
        waited += still * (at - last)
        still *= 1.0 - leaves
        last = at
    return waited, 1.0 - still


def _room_by_lifetime(options: Sequence[Option], horizon_s: float) -> tuple[float, float]:
    """``room_odds`` once lifetimes are learned: room comes at the soonest rank's ``room_at_s``,
    expected, so within ``horizon_s`` or not at all."""
    soonest = min((o.room_at_s for o in options if o.room_at_s is not None), default=None)
    if soonest is None or soonest > horizon_s:
        return horizon_s, 0.0
    return soonest, 1.0


def _cost(option: Option, timed: bool) -> float:
    cost = option.cost_s if timed else None
    return cost if cost is not None else option.cost_tokens


def choose(
    room: Room,
    options: Sequence[Option],
    waited_s: float,
    bound_s: float,
    at_bound: bool,
    learned: bool = True,
    by_lifetime: bool = False,
    overdue: bool = False,
    unmeasured_start_s: float | None = None,
) -> Choice:
    """Admit now (where) or wait, for a session ``waited_s`` into a wait of at most ``bound_s``
    (``learned``: the clocks that predict room, the idle TTL among them, come from the traffic;
    ``by_lifetime``: the options' ``room_at_s`` say when room comes, from sessions' learned
    lifetimes, instead of each quiet session's chance of ending now; ``overdue``: room did not come
    by the time its first wait expected it; ``unmeasured_start_s``: how long its first token would
    wait if admitted now while the ranks' speeds do not say, a typical request's duration)."""
    opts = tuple(options)
    timed = bool(opts) and all(o.seconds_per_token is not None for o in opts)
    if room.allowed:
        costs = [_cost(o, timed) for o in opts if o.rank in room.allowed]
        best_room = min(costs, default=None)
        cheaper = {o.rank for o in opts if best_room is not None and _cost(o, timed) < best_room}
        reason = "room within the budget"
        if cheaper:
            reason += f"; cheaper past it: {', '.join(sorted(cheaper))}"
        allowed, past = room.allowed | cheaper, frozenset(cheaper)
        return Choice(True, "room", allowed, room.victims, opts, 0.0, 1.0, reason, past)
    if not opts:
        left = max(bound_s - waited_s, 0.0)
        reason = "every rank is at its session limit"
        return Choice(False, "wait", frozenset(), {}, opts, left, 0.0, reason)
    best = min(opts, key=lambda o: _cost(o, timed))
    lowest = _cost(best, timed)
    allowed = frozenset(o.rank for o in opts if _cost(o, timed) <= lowest * TIE_FACTOR)
    # Waiting longer than admitting now would delay its first token is a loss to the session itself
    # whatever it spares the others: a wait never runs past that (see the module docstring).
    start: float | None = unmeasured_start_s
    if timed:
        start = min(s for o in opts if o.rank in allowed and (s := o.start_s) is not None)
    odds_within = room_odds if not by_lifetime else _room_by_lifetime
    left = max(bound_s - waited_s, 0.0)
    wait, chance = odds_within(opts, left)
    eviction = best.eviction_s if timed else None
    if at_bound:
        reason = f"waited the bound of {bound_s:.3g} s"
        return Choice(True, "after_wait", allowed, {}, opts, wait, chance, reason)
    if overdue:
        reason = "room did not come when its wait expected it: the least costly ranks"
        return Choice(True, "over_budget", allowed, {}, opts, wait, chance, reason)
    if start is not None and waited_s >= start:
        why = "of prefill queued and its own" if timed else "a typical request's duration"
        reason = (
            f"waited {waited_s:.3g} s, as long as its first token would wait if admitted now "
            f"({start:.3g} s, {why}): the least costly ranks"
        )
        return Choice(True, "over_budget", allowed, {}, opts, wait, chance, reason)
    if not learned or eviction is None:
        why = "the clocks" if not learned else "the ranks' speeds"
        if start is not None:
            left = min(left, start - waited_s)
        reason = f"no room; {why} are not learned yet: the budget holds ({left:.3g} s of waiting left)"
        return Choice(False, "wait", frozenset(), {}, opts, wait, chance, reason)
    if chance <= 0:
        reason = f"no room is coming within the wait bound ({left:.3g} s left): the least costly ranks"
        return Choice(True, "over_budget", allowed, {}, opts, wait, chance, reason)
    odds = f"room within the {left:.3g} s left {chance:.0%} likely, {wait:.3g} s of waiting expected"
    if wait < chance * eviction:
        if start is not None and start - waited_s < left:
            # waiting pays over the bound: does it within the time it may still wait?
            left = start - waited_s
            wait, chance = odds_within(opts, left)
            odds = f"room within the {left:.3g} s it may still wait {chance:.0%} likely"
            if not wait < chance * eviction:
                reason = (
                    f"{odds} (its first token would wait {start:.3g} s if admitted now): not worth "
                    f"what recomputing its evictions costs ({eviction:.3g} s): the least costly ranks"
                )
                return Choice(True, "over_budget", allowed, {}, opts, wait, chance, reason)
            odds += f", {wait:.3g} s of waiting expected"
        reason = f"{odds}: cheaper than recomputing what it evicts ({eviction:.3g} s)"
        return Choice(False, "wait", frozenset(), {}, opts, wait, chance, reason)
    reason = (
        f"{odds}; recomputing what it evicts ({best.expected_recompute_tokens:.0f} tokens, "
        f"{eviction:.3g} s) costs less: the least costly ranks"
    )
    return Choice(True, "over_budget", allowed, {}, opts, wait, chance, reason)


def saturated(queue_s: float | None, waiting_requests: float, bound_s: float) -> bool:
    """Whether a rank's prefill queue is saturated: what is queued there takes ``SATURATED_WAITS``
    wait bounds to compute (``queue_s``: None when its speed is not measured) and it reports
    requests waiting."""
    return queue_s is not None and waiting_requests > 0 and queue_s >= SATURATED_WAITS * bound_s


def overloaded(options: Sequence[Option], bound_s: float) -> float | None:
    """Seconds until the least loaded rank's queue drains, when every rank is ``saturated``; else
    None."""
    drains: list[float] = []
    for o in options:
        queue = o.queue_s
        if queue is None or not saturated(queue, o.waiting_requests, bound_s):
            return None
        drains.append(queue)
    return min(drains) if drains else None
