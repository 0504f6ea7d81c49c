"""Which resident sessions to park so that a waiter past the rotation bound gets a seat: a pure
function over a count (``accounting.count``).

On each healthy rank, the sessions that may be parked are the quiet ones (their latest request
answered) that have been answered since they took their seat, once the waiter has waited the
rotation bound ``hold_s`` (hysteresis: a seat just given is not taken back before it served). A
waiter of a higher priority class parks a lower class's quiet session without waiting.
A waiter coming back to its own blocks (more of its prompt than its agent's head) on a rank that
keeps the blocks its GPU evicts in CPU memory (``Rank.offloads_kv``) does not wait either, but parks
only sessions that held their seat the bound: there parking costs the parked session a reload of its
context when it comes back, not a recompute, and the waiter reloads its own instead of recomputing
them elsewhere. Without the hold, two sessions back to their own blocks on one rank parked each
other at every turn (a replay with a CPU tier half the pool: seats given up 1-20 ms after an answer,
back and forth). On replays at 1.9x the pools with a CPU tier of 4x,
waiting the bound there too held TTFT p99 at 4.0-4.3 s against 3.3-3.4 s (one round each).

They go in order: the lowest class first, then quiet longest since their last answer; on a tie (the
same poll interval), the one that has had the most service for its client key's weight. On each
rank, as few as free the waiter's need (tokens within the budget, and a session place under
``max_sessions_per_rank``); among the ranks, the one that parks the fewest, then one that keeps
the blocks its GPU evicts in CPU memory (``Rank.offloads_kv``: a session parked there costs a reload
of its context when it comes back, not a recompute), then the one holding most of the waiter's
prompt, then the one whose parked session has been quiet longest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from proxy.admission.accounting import RankState
from proxy.admission.room import excess_tokens
from proxy.state.sessions import Session
from routing.ranks import Rank
from tokenization.block_hash import DEFAULT_BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class Parking:
    """The sessions to park on one rank for one waiter."""

    rank: str
    keys: tuple[str, ...]


def parkable(session: Session, now: float, hold_s: float) -> bool:
    """Whether ``session`` may give up its seat now: quiet, answered since it was seated, and seated
    at least ``hold_s`` seconds."""
    seated = max(session.seated_at, session.created)
    return session.answered and session.answered_at >= seated and now - seated >= hold_s


def why_none(states: Mapping[str, RankState], now: float) -> str:
    """Why no rotation could seat a waiter past the bound (``choose_parked`` found none): ``busy``,
    no resident is quiet; ``unserved``, those quiet have not been answered since they were seated;
    ``short``, those that may be parked do not free enough on any one rank."""
    quiet = [session for state in states.values() for session, _ in state.lru if session.answered]
    if not quiet:
        return "busy"
    return "short" if any(parkable(session, now, 0.0) for session in quiet) else "unserved"


def past_pool(state: RankState, now: float) -> tuple[str, ...]:
    """The quiet sessions to park on ``state``'s rank, whose working set grew past what it holds:
    the quiet longest first, each answered since it was seated, until it holds the rest; never its
    last session. Empty when it is within."""
    excess = excess_tokens(state)
    keys: list[str] = []
    for session, _ in state.lru:  # least recently answered first
        if excess <= 0 or len(keys) + 1 >= state.sessions:
            break
        if parkable(session, now, 0.0):
            keys.append(session.key)
            excess -= session.context_tokens
    return tuple(keys)


def choose_parked(
    healthy: Sequence[Rank],
    states: Mapping[str, RankState],
    need: int,
    head_key: str | None,
    head_tokens: int,
    max_sessions_per_rank: int | None,
    now: float,
    waited: float,
    priority: int,
    hold_s: float,
    tie_s: float,
    hits: Mapping[str, int],
    weight: Callable[[str | None], float],
) -> Parking | None:
    """The sessions to park for a waiter needing ``need`` projected tokens (see the module
    docstring); None when no rank can free enough with the sessions parkable now."""
    best: tuple[tuple[int, bool, int, float], Parking] | None = None
    for rank in healthy:
        state = states.get(rank.name)
        if state is None:
            continue
        chosen = _park_on(
            state,
            reloads_own(rank, hits, head_tokens),
            need,
            head_key,
            head_tokens,
            max_sessions_per_rank,
            now,
            waited,
            priority,
            hold_s,
            tie_s,
            weight,
        )
        if chosen is None:
            continue
        quiet = max(now - session.answered_at for session in state_sessions(state, chosen))
        score = (len(chosen), not rank.offloads_kv, -hits.get(rank.name, 0), -quiet)
        if best is None or score < best[0]:
            best = (score, Parking(rank.name, chosen))
    return best[1] if best is not None else None


def reloads_own(rank: Rank, hits: Mapping[str, int], head_tokens: int) -> bool:
    """Whether ``rank`` keeps what its GPU evicts in CPU memory and holds more of a waiter's prompt
    (``hits``: leading blocks per rank) than its agent's head: the waiter's own context, which it
    reloads there rather than recomputes anywhere else."""
    return rank.offloads_kv and hits.get(rank.name, 0) * (rank.block_size or DEFAULT_BLOCK_SIZE) > head_tokens


def state_sessions(state: RankState, keys: tuple[str, ...]) -> list[Session]:
    """The sessions of ``state``'s rank named by ``keys``."""
    wanted = set(keys)
    return [session for session, _ in state.lru if session.key in wanted]


def _park_on(
    state: RankState,
    reload_only: bool,
    need: int,
    head_key: str | None,
    head_tokens: int,
    cap: int | None,
    now: float,
    waited: float,
    priority: int,
    hold_s: float,
    tie_s: float,
    weight: Callable[[str | None], float],
) -> tuple[str, ...] | None:
    """The fewest sessions of ``state``'s rank whose parking seats the waiter there, or None
    (``reload_only``: parking costs reloads only, so the bound is not waited; module docstring)."""
    wanted = need - head_tokens if head_key is not None and head_key in state.heads else need
    missing_tokens = 0
    if state.budget_tokens is not None:
        missing_tokens = state.projected_tokens + state.reserved_tokens + wanted - state.budget_tokens
    if state.holds_tokens is not None:  # a rank past what it holds takes nobody until back within
        missing_tokens = max(missing_tokens, state.working_set_tokens - state.holds_tokens + 1)
    seated = state.sessions + state.reserved_sessions
    missing_seats = seated - cap + 1 if cap is not None else 0
    if missing_tokens <= 0 and missing_seats <= 0:
        return None  # it has room: nothing to park here (the room check would have found it)

    def order(item: tuple[Session, int]) -> tuple[int, int, float]:
        session = item[0]
        quiet_ticks = int((now - session.answered_at) / tie_s) if tie_s > 0 else 0
        return (session.priority, -quiet_ticks, -session.turns / max(weight(session.client), 1e-9))

    def due(session: Session) -> bool:
        if session.priority < priority:
            return parkable(session, now, 0.0)  # a higher class waits neither for the bound nor the hold
        if reload_only:
            # a session back to its own blocks on a rank that offloads them (no recompute on either
            # side) does not wait the bound; the seat it takes is still held one bound, or two such
            # sessions would park each other at every turn
            return parkable(session, now, hold_s)
        # past the bound, any quiet resident answered since it was seated: holding seats one more
        # bound left 4-26 of a cell's waiters seated late (docs/investigations.md, "Seats held")
        return waited >= hold_s and parkable(session, now, 0.0)

    candidates = sorted((item for item in state.lru if due(item[0])), key=order)
    chosen: list[str] = []
    for session, freed in candidates:
        if missing_tokens <= 0 and missing_seats <= 0:
            break
        chosen.append(session.key)
        missing_tokens -= freed
        missing_seats -= 1
    emptied = len(chosen) == state.sessions and state.reserved_sessions == 0
    if (missing_tokens <= 0 and missing_seats <= 0) or (chosen and emptied):
        return tuple(chosen)  # an emptied rank always has room (``room.find_room``)
    return None
