"""Admission's ledger: where every session is counted, what is reserved, and what the answers,
the failures and time change about it (``gate.Admission`` adds the decisions on top).

Reads (``count``) change nothing; ``refresh`` (on the admission path and a timer) applies what time
changed: expired reservations, ended sessions, the learned idle TTL, pool overruns logged.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol

from proxy.admission.accounting import RankState, Reservation, budget_tokens, count, log_over_pool
from proxy.admission.config import RESERVATION_TTL_S, AdmissionConfig
from proxy.admission.explain import note_placed
from proxy.admission.growth import PeakEstimator
from proxy.admission.moves import Moves
from proxy.admission.queue import WaitQueue
from proxy.admission.rank_speed import RankSpeeds
from proxy.admission.room import Room, find_room
from proxy.admission.timing import LearnedTime
from proxy.admission.turns import settle
from proxy.context import Admitted, Outcome, RequestContext
from proxy.errors import CLIENT_CLOSED
from proxy.ops.metrics import Metrics
from proxy.state.claims import Ask, LocalClaims, RoomClaims
from proxy.state.sessions import Session, SessionTable
from routing.rank_metrics import RankSample
from routing.ranks import Fleet, Rank

log = logging.getLogger("prefixgate.admission")

#: Think-gap counts and answer times kept for sessions no longer active, so that one coming back is
#: not counted from zero again (the least recently seen go first).
GAP_COUNTS_KEPT = 10_000


class Placement(Protocol):
    """What admission reads of routing: the prefix index and the prefill queued per rank."""

    def holds(self, block_hashes: Sequence[bytes]) -> dict[str, int]: ...

    def queued(self, rank: str) -> int: ...


class Ledger:
    """Admission's accounting: the count, reservations, learned clocks and rank speeds, and the
    session updates after routing and after the answer (``Admission`` adds the decisions)."""

    def __init__(
        self,
        table: SessionTable,
        fleet: Fleet,
        config: AdmissionConfig,
        metrics: Metrics | None = None,
        placement: Placement | None = None,
        claims: RoomClaims | None = None,
        speeds: RankSpeeds | None = None,
    ) -> None:
        """``claims``: where room is taken, shared by replicas with Redis (None: this process's);
        ``speeds``: what the ranks' metrics teach of their
        prefill speeds, shared with routing (None: admission's own)."""
        self.table = table
        self.claims: RoomClaims = claims if claims is not None else LocalClaims()
        self.fleet = fleet
        self.config = config
        self.metrics = metrics
        self.placement = placement
        self.time = LearnedTime(config)
        self.speeds = speeds if speeds is not None else RankSpeeds()
        # through ``self.claims`` at the first wait: whichever claims admission has by then
        self.queue = WaitQueue(self.poll_interval(), lambda wake: self.claims.watch(wake))
        self._reservations: dict[str, Reservation] = {}
        self._over_pool: set[str] = set()
        #: Client keys' fair-share weights, by label, as their requests show them (who is parked).
        self._weights: dict[str, float] = {}
        #: Peaks of the sessions that ended (idled out or deleted): how far sessions grow.
        self.peaks = PeakEstimator()
        #: Active sessions at the last refresh and their context: one missing next time has ended.
        self._live: dict[str, int] = {}
        #: Each session's think-gap count and answer time at the refresh that last saw it (``_learn``).
        self._seen: dict[str, tuple[int, float]] = {}
        self.moves = Moves(fleet, config, self.refresh, self._room, self._reserve, self.projected)

    def typical_gap(self) -> float | None:
        """A long think gap across sessions (their 95th percentile), once enough are known."""
        return self.time.typical_gap()

    def release_after(self, session: Session) -> float:
        """Quiet seconds after its last answer from which ``session`` has most likely ended
        (``AdmissionConfig.release_after``'s think-gap rule)."""
        return self.time.release_rule()(session)

    def poll_interval(self) -> float:
        return self.config.poll_interval(self.time.idle_ttl())

    def clocks(self) -> dict[str, float | bool | None]:
        """The clocks in force and whether the traffic taught them (a read, for ``/metrics`` and the
        dashboard)."""
        return {
            "idle_ttl_s": self.time.idle_ttl(),
            "wait_bound_s": self.time.wait_bound(),
            "learned": self.time.learned(),
        }

    def _room(
        self,
        tokens: int,
        head_key: str | None,
        head_tokens: int,
        states: dict[str, RankState],
        *,
        release: bool = True,
    ) -> Room:
        """``room.find_room`` for a session of ``tokens`` projected as sessions of its size grew."""
        return find_room(
            self.fleet.healthy(),
            states,
            self.projected(tokens),
            head_key,
            head_tokens,
            self.config.max_sessions_per_rank,
            release=release,
        )

    def _reserve(
        self,
        key: str,
        room: Room,
        tokens: int,
        head_key: str | None = None,
        head_tokens: int = 0,
    ) -> frozenset[str]:
        """Reserve ``tokens`` for session ``key`` on the ranks of ``room`` that the claims still
        grant (another replica may have taken the room, or a rank's last session place, since this
        count). The ranks granted, empty when none is."""
        budgets = {name: self._budget(name) for name in room.allowed}
        body = tokens - head_tokens if head_key is not None else tokens
        ttl, cap = self.time.idle_ttl(), self.config.max_sessions_per_rank
        granted = self.claims.reserve(
            Ask(key, budgets, body, head_key, head_tokens, ttl, RESERVATION_TTL_S, cap)
        )
        if granted:
            # in the same step as the room check: the next waiter must see this session's claim
            victims = {name: keys for name, keys in room.victims.items() if name in granted}
            self._reservations[key] = Reservation(granted, tokens, victims)
        return granted

    def _budget(self, name: str) -> int | None:
        rank = self.fleet.get(name)
        return budget_tokens(rank, self.config.target_fraction) if rank is not None else None

    def _claim(self, session: Session, rank: str) -> None:
        """``session`` holds its projected working set on ``rank`` (its head counted once there)."""
        head = session.head_key
        shared = min(session.head_tokens, session.context_tokens) if head is not None else 0
        body = self.projected(session.context_tokens) - shared
        self.claims.claim(session.key, rank, body, head, shared)

    def reservation(self, key: str) -> Reservation | None:
        """The session's pending claim on room (between its room check and its rank's pick)."""
        return self._reservations.get(key)

    # -- accounting -------------------------------------------------------------------------------

    def count(self, now: float | None = None) -> dict[str, RankState]:
        """Working set and session count per rank (a read: changes nothing)."""
        now = self.table.clock() if now is None else now
        return self._count(self.table.active(now), now)

    def _count(self, active: list[Session], now: float) -> dict[str, RankState]:
        return count(
            self.fleet,
            active,
            self._reservations.values(),
            self.config,
            now,
            self.peaks.expected_peak,
            self.time.release_rule(),
            self.time.idle_ttl(),
        )

    def refresh(self, now: float | None = None) -> dict[str, RankState]:
        """Apply what time changed (expired reservations, sessions that ended, the learned idle TTL,
        pools overrun) and return the count."""
        now = self.table.clock() if now is None else now
        self._expire_reservations()
        self.table.set_idle_ttl(self.time.idle_ttl())
        self.queue.poll_interval = self.poll_interval()
        active = self.table.active(now)
        self._learn(active)
        self._note_ended({session.key: session.context_tokens for session in active})
        states = self._count(active, now)
        self.moves.counted(states)
        log_over_pool(states, self._over_pool)
        return states

    def projected(self, tokens: int) -> int:
        """The room a session of ``tokens`` needs: as large as sessions of its size grew before ending."""
        return self.peaks.expected_peak(tokens)

    def _learn(self, active: list[Session]) -> None:
        """What the table shows closed since the last refresh: each active session's new think gaps
        and its newly answered request's duration. Learned from the table every replica shares, so
        N replicas learn what one serving everything learns (one that learned from its own requests
        alone needed N times the traffic to learn its clocks)."""
        for session in active:
            self._learn_from(session)
        seen = self._seen
        while len(seen) > len(active) + GAP_COUNTS_KEPT:  # ended sessions, least recently seen first
            del seen[next(iter(seen))]

    def _learn_from(self, session: Session) -> None:
        """Learn what ``session``'s record shows new since it was last seen."""
        seen = self._seen
        gaps, answered = seen.pop(session.key, (0, 0.0))  # re-inserted: the order is last seen
        if session.answered_at > answered and session.served_s > 0:
            self.time.note_duration(session.served_s)
        seen[session.key] = (max(session.gaps, gaps), max(session.answered_at, answered))
        if session.gaps > gaps:
            self.time.note_gap(session.gap_last)

    def _note_ended(self, live: dict[str, int]) -> None:
        """Sessions active at the last refresh and not now have ended: their last context is their
        peak (unless admission parked or released them: cut short, they may come back and grow on)."""
        for key, tokens in self._live.items():
            if key not in live:
                self.claims.release(key)
                ended = self.table.get(key, breaks=False)
                if ended is None or not ended.released:
                    self.peaks.add(tokens)
        self._live = live

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        for key in [k for k, r in self._reservations.items() if not r.live(now)]:
            del self._reservations[key]

    # -- what the ranks measure -------------------------------------------------------------------

    def observe_rank(self, rank: str, sample: RankSample) -> None:
        """A rank's new ``/metrics`` figures (the poller's callback): its speed; waiters re-check."""
        self.speeds.observe(rank, sample)
        self.queue.notify()

    # -- after routing and after the answer -------------------------------------------------------

    def placed(self, ctx: RequestContext, rank: Rank) -> None:
        """The router sent the admitted request to ``rank``: its reservation becomes the session's
        place there (releasing the ended sessions it was counted against, if any)."""
        admitted = ctx.admitted
        session = admitted.session if admitted is not None else None
        if admitted is None or session is None:
            return
        reservation = self._reservations.pop(session.key, None)
        if reservation is not None and reservation.victims.get(rank.name):
            victims = reservation.victims[rank.name]
            self.moves.release_idle(self.table, rank.name, victims, session.key, self.release_after)
            for victim in victims:
                released = self.table.get(victim, breaks=False)
                if released is not None and released.released:
                    self.claims.release(victim)
        if admitted.fresh:
            note_placed(session, rank.name)
        moved = session.rank != rank.name
        self.moves.move(self.table, session, rank.name)
        if admitted.fresh or moved or reservation is not None:  # else its answer updates the claim
            self._claim(session, rank.name)

    def finished(self, outcome: Outcome) -> None:
        """The request ended: the session's counters and its context after the answer; a request
        that failed or was refused releases what admission counted for it."""
        admitted = outcome.ctx.admitted
        session = admitted.session if admitted is not None else None
        if admitted is None or session is None:
            return
        if outcome.rank is None or (outcome.status >= 400 and outcome.status != CLIENT_CLOSED):
            self._unwind(admitted, session)
            return
        if not outcome.answered:
            return
        rank = outcome.rank
        self.moves.move(self.table, session, rank)  # a retry may have answered elsewhere
        session.last_seen = max(session.last_seen, self.table.clock())
        estimated = outcome.ctx.estimated_cached_tokens
        if estimated is not None:
            session.hit_tokens_estimated += estimated
        usage = outcome.usage
        if usage is not None:
            self.moves.track(rank, settle(session, usage, self.config.block_size))
        session.served_s = 0.0 if admitted.waited_s else time.perf_counter() - outcome.ctx.started
        session.answered_at = session.last_seen
        if outcome.ctx.session_ends:
            self._end(session, "the client said the session ended (its last request was answered)")
            return
        self.table.save(session)
        self._claim(session, rank)
        if len(self.queue):
            self.speeds.wanted()
        self.queue.notify()

    def _unwind(self, admitted: Admitted, session: Session) -> None:
        """Nothing counted for a failed request keeps counting: its reservation, its turn, and a
        session it created (or admitted anew) ends as it was."""
        self._reservations.pop(session.key, None)
        before = admitted.before
        if before is None:
            self.table.delete(session.key)
        else:
            (before.restore_all if admitted.fresh else before.restore_turn)(session)
            self.table.save(session)
        if before is None or admitted.fresh or session.rank is None:
            self.claims.release(session.key)
        else:
            self._claim(session, session.rank)
        self.moves.forget_counts()
        self.queue.notify()

    def _end(self, session: Session, reason: str) -> None:
        """``session`` has ended: its seat is free at once for whoever waits; its record stays, marked
        ended, until it idles out (a request under its key later starts it again)."""
        session.released = True
        record = session.admission or {}
        session.admission = {**record, "decision": "ended", "reason": reason, "at": self.table.clock()}
        self.table.save(session)
        self.claims.release(session.key)
        self.peaks.add(session.context_tokens)  # its last context is its peak
        log.info("session %s ended after %d turns: %s", session.key, session.turns, reason)
        self.queue.notify()

    def release(self, key: str) -> Session | None:
        """End a session at once (``DELETE /admin/sessions/{id}``): its budget is free for the queue."""
        self._reservations.pop(key, None)
        session = self.table.delete(key)  # first: the claim's release wakes other replicas' waiters
        self.claims.release(key)
        if session is not None:
            self._learn_from(session)  # what no refresh saw of it yet
        self.queue.notify()
        return session

    # -- metrics and logs -------------------------------------------------------------------------

    def _rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.admission_rejected.labels(reason).inc()

    def _set_queue_depth(self, depth: int) -> None:
        if self.metrics is not None:
            self.metrics.admission_queue_depth.set(depth)
