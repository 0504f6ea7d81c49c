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
session at once (with any rank that costs less than the best of those). With no room anywhere the
session waits while room is expected within the wait bound (the rank's quiet sessions reaching the
time they are judged ended, each freeing its room times the chance it does not come back first) and
sooner than the recompute the best rank's evictions would cause: when the ranks compute fast,
evicting costs little and the session goes in; when they are compute-bound, the budget holds until
room comes. When no room is coming within the bound it is admitted on the least costly rank at
once, and past the bound in any case: a session that can run is never refused for lack of room.
Until the clocks and the ranks' speeds are learned (the first requests), the budget holds up to the
bound.
"""

from __future__ import annotations

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
    #: Seconds until room is expected here (sessions judged ended, each counted for the chance it does
    #: not come back first, freeing the shortfall); None: not expected.
    room_in_s: float | None
    waiting_requests: float = 0.0

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
    room_in_s: float | None
    reason: str


def option(
    candidate: Candidate,
    prompt_tokens: int,
    need: int,
    now: float,
    return_probability: Callable[[float], float],
    ends_at: Callable[[Session], float],
    rounds: float = 1.0,
) -> Option:
    """The cost of admitting on ``candidate``'s rank a session of ``prompt_tokens`` that needs
    ``need`` projected tokens of room there (its share not held yet), for ``rounds`` turns."""
    state = candidate.state
    budget = state.budget_tokens
    over = 0 if budget is None else state.projected_tokens + state.reserved_tokens + need - budget
    short = over
    evicted = 0
    expected = 0.0
    # the sessions likely to come back, each weighted by its chance: what the pool must keep holding
    live = float(state.projected_tokens + state.reserved_tokens + need)
    #: (when it is judged ended, the room it frees then times the chance it does not come back first)
    departures: list[tuple[float, float]] = []
    for session, freed in state.lru:
        chance = return_probability(now - session.answered_at) if session.answered else 1.0
        live -= (1.0 - chance) * freed
        if session.answered:
            departures.append((ends_at(session), (1.0 - chance) * freed))
        if over <= 0:
            continue
        take = min(freed, over)
        evicted += take
        expected += chance * take
        over -= take
    if over > 0:  # held by reservations and new arrivals: nothing known frees it
        evicted += over
        expected += over
    # room comes when the sessions expected to leave have freed the shortfall
    room_in: float | None = None
    freed_by = 0.0
    for at, gain in sorted(departures):
        freed_by += gain
        if freed_by >= short:
            room_in = max(at - now, 0.0)
            break
    if state.pool_tokens is not None and live > state.pool_tokens:
        expected += (live - state.pool_tokens) * max(rounds - 1.0, 0.0)
    return Option(
        state.name,
        max(prompt_tokens - candidate.hit_tokens, 0),
        candidate.queued_prefill_tokens,
        evicted,
        expected,
        candidate.seconds_per_token,
        room_in,
        candidate.waiting_requests,
    )


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
) -> Choice:
    """Admit now (where) or wait, for a session ``waited_s`` into a wait of at most ``bound_s``
    (``learned``: the clocks that predict room, the idle TTL among them, come from the traffic)."""
    opts = tuple(options)
    timed = bool(opts) and all(o.seconds_per_token is not None for o in opts)
    if room.allowed:
        costs = [_cost(o, timed) for o in opts if o.rank in room.allowed]
        best_room = min(costs, default=None)
        cheaper = {o.rank for o in opts if best_room is not None and _cost(o, timed) < best_room}
        reason = "room within the budget"
        if cheaper:
            reason += f"; cheaper past it: {', '.join(sorted(cheaper))}"
        return Choice(True, "room", room.allowed | cheaper, room.victims, opts, 0.0, reason)
    rooms = [o.room_in_s for o in opts if o.room_in_s is not None]
    room_in = min(rooms, default=None)
    if not opts:
        return Choice(False, "wait", frozenset(), {}, opts, room_in, "every rank is at its session limit")
    best = min(opts, key=lambda o: _cost(o, timed))
    lowest = _cost(best, timed)
    allowed = frozenset(o.rank for o in opts if _cost(o, timed) <= lowest * TIE_FACTOR)
    left = bound_s - waited_s
    eviction = best.eviction_s if timed else None
    if at_bound:
        return Choice(True, "after_wait", allowed, {}, opts, room_in, f"waited the bound of {bound_s:.3g} s")
    if not learned or eviction is None:
        why = "the clocks" if not learned else "the ranks' speeds"
        reason = f"no room; {why} are not learned yet: the budget holds up to the bound ({left:.3g} s left)"
        return Choice(False, "wait", frozenset(), {}, opts, room_in, reason)
    if room_in is None or room_in > left:
        when = "no room is coming" if room_in is None else f"room only in {room_in:.3g} s"
        reason = f"{when}, past the wait bound ({left:.3g} s left): the least costly rank"
        return Choice(True, "over_budget", allowed, {}, opts, room_in, reason)
    if eviction <= room_in:
        reason = (
            f"recomputing what it evicts ({best.expected_recompute_tokens:.0f} tokens, {eviction:.3g} s) "
            f"costs less than waiting {room_in:.3g} s for room"
        )
        return Choice(True, "over_budget", allowed, {}, opts, room_in, reason)
    reason = f"room expected in {room_in:.3g} s, sooner than recomputing what it evicts ({eviction:.3g} s)"
    return Choice(False, "wait", frozenset(), {}, opts, room_in, reason)


def overloaded(options: Sequence[Option], bound_s: float) -> float | None:
    """Seconds until the least loaded rank's queue drains, when every rank is saturated (its queued
    prefill takes ``SATURATED_WAITS`` wait bounds and it reports requests waiting); else None."""
    drains: list[float] = []
    for o in options:
        queue = o.queue_s
        if queue is None or o.waiting_requests <= 0 or queue < SATURATED_WAITS * bound_s:
            return None
        drains.append(queue)
    return min(drains) if drains else None
