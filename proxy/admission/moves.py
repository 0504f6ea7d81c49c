"""Sessions moving between ranks in admission's count: a placement, a retry landing elsewhere, a
session re-homed off a rank whose sessions outgrew its pool, and the ended sessions a new one takes
the room of.

Each rank's working set at the last full count is kept current as sessions grow and move, so a
session's turn checks its rank against it before counting everything again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from proxy.admission.accounting import RankState
from proxy.admission.config import AdmissionConfig
from proxy.admission.room import Room, excess_tokens, should_move
from proxy.state.sessions import Session, SessionTable
from routing.ranks import Fleet

log = logging.getLogger("prefixgate.admission")


class Moves:
    """Where sessions are counted, as they move; the gate's count, room check and reservations."""

    def __init__(
        self,
        fleet: Fleet,
        config: AdmissionConfig,
        refresh: Callable[[], dict[str, RankState]],
        room: Callable[..., Room],
        reserve: Callable[[str, Room, int], frozenset[str]],
        projected: Callable[[int], int],
    ) -> None:
        self.fleet = fleet
        self.config = config
        self._refresh = refresh
        self._room = room
        self._reserve = reserve
        self._projected = projected
        self._last_working_set: dict[str, int] = {}

    def counted(self, states: dict[str, RankState]) -> None:
        """A full count happened: the tracked working sets start from it."""
        self._last_working_set = {name: state.working_set_tokens for name, state in states.items()}

    def forget_counts(self) -> None:
        """The tracked working sets are off (a failed request was undone): count again next time."""
        self._last_working_set = {}

    def track(self, rank: str, delta: int) -> int | None:
        """Keep the last count of ``rank``'s working set current between full counts as its sessions
        grow, arrive and leave; its new value (None before the first count)."""
        last = self._last_working_set.get(rank)
        if last is None:
            return None
        last = self._last_working_set[rank] = last + delta
        return last

    def move(self, table: SessionTable, session: Session, rank: str) -> None:
        if session.rank != rank:
            if session.rank is not None:
                self.track(session.rank, -session.context_tokens)
            self.track(rank, session.context_tokens)
            session.rank = rank
            table.save(session)

    def rehome(
        self, session: Session, old_tokens: int, head_key: str | None, head_tokens: int
    ) -> frozenset[str] | None:
        """The ranks with room to move ``session`` to, when its rank's sessions have outgrown its pool
        and ``session`` is the one to go (``room.should_move``); None: it stays. Only to a rank with
        room for its projected size as it stands (nobody is released for a move)."""
        rank = self.fleet.get(session.rank) if session.rank is not None else None
        if rank is None or not rank.pool_tokens:
            return None
        last = self.track(rank.name, session.context_tokens - old_tokens)
        if last is not None and last <= rank.pool_tokens:
            return None  # the cheap check (an over-estimate: shared heads count in full)
        states = self._refresh()
        state = states[rank.name]
        if not should_move(state, session.key):
            return None
        room = self._room(session.context_tokens, head_key, head_tokens, states, release=False)
        allowed = room.allowed - {rank.name}
        if not allowed:
            return None
        log.info(
            "session %s re-homed before its turn %d: %s holds %d tokens past its pool of %d; room on %s",
            session.key,
            session.turns - 1,
            rank.name,
            excess_tokens(state),
            rank.pool_tokens,
            ", ".join(sorted(allowed)),
        )
        # None when the shared claims granted none of them: another replica took that room first
        granted = self._reserve(session.key, Room(allowed), self._projected(session.context_tokens))
        return granted or None

    def release_idle(
        self,
        table: SessionTable,
        rank: str,
        keys: tuple[str, ...],
        for_key: str,
        release_after: Callable[[Session], float],
    ) -> None:
        """End sessions the new session ``for_key`` took the room of (unless they came back since)."""
        now = table.clock()
        for key in keys:
            session = table.get(key, breaks=False)
            if session is None or session.released or session.rank != rank or not session.answered:
                continue
            if now - session.answered_at <= release_after(session):
                continue  # it sent a request since the room check
            session.released = True
            table.save(session)
            log.info(
                "session %s released before its turn %d on %s after %.1f s idle (longest think gap %.1f s) "
                "for %s",
                key,
                session.turns,
                rank,
                now - session.answered_at,
                session.gap_max,
                for_key,
            )
