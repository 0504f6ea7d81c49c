"""Admission's policy: which ranks have room for a new session, and which session leaves a rank
whose sessions outgrew its pool. Pure functions over a count (``accounting.count``).

- A new session (or one back after idling out) may only go to a rank with room: the budget minus
  the projected working set fits its projected size (an empty rank always has room), the rank
  holds fewer than ``max_sessions_per_rank`` sessions and its working set does not exceed its
  pool. With ``head_key``, a rank already holding that shared head needs room for the rest only.
- Ranks that have room only once reclaimable sessions (judged ended: idle past their think times)
  are released count as having room too, even when another rank has room as is: the router then
  weighs them by what they hold (a rank holding the new session's prefix is worth releasing an
  ended session's budget for), and the sessions are released only if it picks that rank.
- When a rank's sessions have outgrown its pool anyway (their growth outran the projection), one of
  them moves, once, at its own turn, to a rank with room: the smallest whose context covers the
  excess (the cheapest to recompute that ends it; the largest when none does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from proxy.admission.accounting import RankState
from routing.ranks import Rank


@dataclass(frozen=True, slots=True)
class Room:
    """Where a new session may go: the ranks, and per rank the sessions to release for it (on
    ranks that have room only once those go)."""

    allowed: frozenset[str]
    victims: dict[str, tuple[str, ...]] = field(default_factory=dict)


def find_room(
    healthy: Sequence[Rank],
    states: dict[str, RankState],
    need: int,
    head_key: str | None,
    head_tokens: int,
    max_sessions_per_rank: int | None,
    *,
    release: bool = True,
) -> Room:
    """The healthy ranks with room for a new session needing ``need`` projected tokens (see the
    module docstring). ``release=False``: ranks with room as they are only."""
    allowed = []
    short: dict[str, int] = {}  # rank -> tokens missing, for ranks only the budget keeps out
    for rank in healthy:
        state = states[rank.name]
        held = head_key is not None and head_key in state.heads
        wanted = need - head_tokens if held else need
        if state.over_pool:
            continue
        cap = max_sessions_per_rank
        if cap is not None and state.sessions + state.reserved_sessions >= cap:
            continue
        if state.budget_tokens is not None:
            used = state.projected_tokens + state.reserved_tokens
            empty = state.sessions + state.reserved_sessions == 0
            if used + wanted > state.budget_tokens and not empty:
                short[rank.name] = used + wanted - state.budget_tokens
                continue
        allowed.append(rank.name)
    if not short or not release:
        return Room(frozenset(allowed))
    # room once sessions that have most likely ended are released, longest idle first
    victims: dict[str, tuple[str, ...]] = {}
    for name, missing in short.items():
        chosen: list[str] = []
        for session, freed in states[name].reclaimable:
            if missing <= 0:
                break
            chosen.append(session.key)
            missing -= freed
        if missing <= 0:
            victims[name] = tuple(chosen)
    return Room(frozenset(allowed).union(victims), victims)


def excess_tokens(state: RankState) -> int:
    """Tokens ``state``'s working set holds past what its rank holds (0 or less: within it)."""
    return state.working_set_tokens - state.holds_tokens if state.holds_tokens else 0


def should_move(state: RankState, session_key: str) -> bool:
    """Whether ``session_key`` is the session to move off ``state``'s rank, whose sessions outgrew
    its pool: the smallest whose context covers the excess (the largest when none does)."""
    excess = excess_tokens(state)
    if excess <= 0 or len(state.members) < 2:
        return False
    covering = [m for m in state.members if m[1] >= excess]
    chosen = min(covering, key=lambda m: m[1]) if covering else max(state.members, key=lambda m: m[1])
    return chosen[0] == session_key
