"""Admission's accounting: each rank's share of the active sessions and pending reservations.

``count`` is a pure function of the active sessions, the reservations and the growth and think-gap
models: it changes nothing, so the dashboard, ``/metrics`` and the admission decisions can all call
it. Two refinements keep the count close to what the rank's prefix cache really holds:

- Sessions of one agent share their leading system+tools segment (about 15k tokens for Claude
  Code), and a rank caches those blocks once: a rank's working set counts each distinct head once.
- Room is counted in *projected* tokens: each active session as large as recently ended sessions
  of at least its size grew (``proxy/admission/learned.py``).

What a rank holds (``held_tokens``) is its GPU pool, plus its CPU tier on a rank that offloads KV:
a session whose blocks the GPU evicts there costs a reload, not a recompute. The tier's size is
learned from the rank's KV events (``Rank.cpu_tier_tokens``); until it has shown it, what the rank
holds is not bounded (the tier is taken as large enough), so neither its budget nor its pool binds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from proxy.admission.config import RESERVATION_TTL_S, AdmissionConfig
from proxy.state.sessions import Session
from routing.ranks import Fleet, Rank

log = logging.getLogger("prefixgate.admission")


@dataclass(slots=True)
class RankState:
    """One rank's share of the active sessions, as admission counts it."""

    name: str
    #: The rank's GPU pool.
    pool_tokens: int | None
    budget_tokens: int | None
    #: What the rank's KV tiers hold (``held_tokens``; None: unbounded): past it, sessions evict
    #: each other's blocks for good.
    holds_tokens: int | None = None
    working_set_tokens: int = 0
    #: The working set as its sessions are expected to grow (``PeakEstimator``): what the budget holds.
    projected_tokens: int = 0
    sessions: int = 0
    reserved_tokens: int = 0
    reserved_sessions: int = 0
    #: When its oldest active session idles out (wall-clock seconds), for Retry-After.
    next_idle_at: float | None = None
    #: Distinct shared heads held (head key -> sessions holding it) and the tokens not double-counted.
    heads: dict[str, int] = field(default_factory=dict)
    shared_head_tokens: int = 0
    #: Sessions past their own release time, longest idle first, with the projected tokens releasing
    #: each frees.
    reclaimable: list[tuple[Session, int]] = field(default_factory=list)
    #: Every session in the order the rank's cache evicts them (least recently answered first, those
    #: in flight last), with the projected tokens each frees.
    lru: list[tuple[Session, int]] = field(default_factory=list)
    #: Its sessions' keys and context tokens.
    members: list[tuple[str, int]] = field(default_factory=list)

    @property
    def over_pool(self) -> bool:
        """The working set exceeds what the rank holds (its pool, and its CPU tier when it has one)."""
        return self.holds_tokens is not None and self.working_set_tokens > self.holds_tokens


@dataclass(slots=True)
class Reservation:
    """A new session's claim on room, from the room check until the router's pick."""

    allowed: frozenset[str]
    tokens: int
    #: Per allowed rank, the reclaimable sessions it only has room with once they are released.
    victims: dict[str, tuple[str, ...]] = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)

    def live(self, now_monotonic: float) -> bool:
        """Not yet past ``RESERVATION_TTL_S`` (a reservation never routed: its request failed early)."""
        return self.since >= now_monotonic - RESERVATION_TTL_S


def held_tokens(rank: Rank) -> int | None:
    """What ``rank``'s KV cache holds, in tokens: its GPU pool, plus its CPU tier on a rank that
    offloads KV (None: not bounded as far as admission knows: the pool is unknown, or the rank
    offloads and its CPU tier has not shown its size yet)."""
    pool = rank.pool_tokens
    if not pool or not rank.offloads_kv:
        return pool or None
    tier = rank.cpu_tier_tokens
    return pool + tier if tier is not None else None


def budget_tokens(rank: Rank, target_fraction: float) -> int | None:
    """``rank``'s seat budget: ``target_fraction`` of what it holds (None: the budget does not bind)."""
    held = held_tokens(rank)
    return int(held * target_fraction) if held else None


def count(
    fleet: Fleet,
    active: Iterable[Session],
    reservations: Iterable[Reservation],
    config: AdmissionConfig,
    now: float,
    expected_peak: Callable[[int], int],
    release_after: Callable[[Session], float],
    idle_ttl: float,
) -> dict[str, RankState]:
    """Working set and session count per rank from the ``active`` sessions and live reservations
    (``idle_ttl``: the one in force, configured or learned; ``release_after``: a session's quiet
    seconds after which it has most likely ended)."""
    fraction = config.target_fraction
    states = {
        r.name: RankState(r.name, r.pool_tokens, budget_tokens(r, fraction), held_tokens(r)) for r in fleet
    }
    live = [r for r in reservations if r.live(time.monotonic())]
    # sessions a pending reservation will release: their room is spoken for already
    claimed = {(name, victim) for r in live for name, victims in r.victims.items() for victim in victims}
    reclaimable: list[tuple[float, Session, RankState, int]] = []
    by_recency: list[tuple[float, Session, RankState, int]] = []
    for session in active:
        state = states.get(session.rank) if session.rank is not None else None
        if state is None or (state.name, session.key) in claimed:
            continue
        tokens = session.context_tokens
        peak = projected = expected_peak(tokens)  # once per session: the lists below reuse it
        head = session.head_key
        if head is not None:
            held = state.heads.get(head, 0)
            if held:
                shared = min(session.head_tokens, tokens)
                tokens -= shared
                projected -= shared
                state.shared_head_tokens += session.head_tokens
            state.heads[head] = held + 1
        state.working_set_tokens += tokens
        state.projected_tokens += projected
        state.sessions += 1
        state.members.append((session.key, session.context_tokens))
        idle_at = session.last_seen + idle_ttl
        if state.next_idle_at is None or idle_at < state.next_idle_at:
            state.next_idle_at = idle_at
        answered = session.answered
        by_recency.append((session.answered_at if answered else now, session, state, peak))
        if answered and now - session.answered_at > release_after(session):
            reclaimable.append((session.answered_at, session, state, peak))
    by_recency.sort(key=_first)
    reclaimable.sort(key=_first)  # longest idle first
    for _, session, state, peak in by_recency:
        state.lru.append((session, _freed(session, state, peak)))
    for _, session, state, peak in reclaimable:
        state.reclaimable.append((session, _freed(session, state, peak)))
    for reservation in live:
        for name in reservation.allowed:
            rank_state = states.get(name)
            if rank_state is not None:
                rank_state.reserved_tokens += reservation.tokens
                rank_state.reserved_sessions += 1
    return states


def _first(item: tuple[float, Session, RankState, int]) -> float:
    return item[0]


def _freed(session: Session, state: RankState, peak: int) -> int:
    """The projected tokens ``session`` (expected to peak at ``peak``) leaving ``state``'s rank
    frees: a head other sessions also hold stays cached, so releasing frees the rest only."""
    shared = session.head_key is not None and state.heads[session.head_key] > 1
    return max(peak - (session.head_tokens if shared else 0), 0)


def log_over_pool(states: dict[str, RankState], over: set[str]) -> None:
    """Say when a rank's active working set goes past its pool and when it is back within it;
    ``over`` holds the ranks past it at the last count (updated)."""
    for state in states.values():
        if state.over_pool and state.name not in over:
            over.add(state.name)
            log.warning(
                "rank %s: active working set %d tokens exceeds what it holds, %s tokens "
                "(%d sessions): no new sessions go there until it shrinks",
                state.name,
                state.working_set_tokens,
                state.holds_tokens,
                state.sessions,
            )
        elif not state.over_pool and state.name in over:
            over.discard(state.name)
            log.info("rank %s: working set back within its pool", state.name)
