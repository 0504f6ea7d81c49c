"""Stage 5, admit: keep each rank's active sessions within its KV pool budget.

A rank's budget is ``pool_tokens x target_fraction``: past about 0.8 of the pool, long sessions
evict each other's cached blocks and the hit rate collapses. A session's working set is its current
context (the prompt of its latest turn plus the answer); sessions seen within ``idle_ttl`` count
against their rank's budget (``accounting.count``).

- A session already active is always admitted, whatever it has grown to, and homed on its rank
  (``Admitted.home``): the router keeps it there unless that rank is down or truly saturated. When
  its rank's sessions have outgrown the pool, it may be the one moved (``room.should_move``).
- A new session (or one back after idling out) may only go to a rank with room (``room.find_room``);
  with none it waits, first come first served (``queue.WaitQueue``), up to ``wait`` seconds, then
  gets 429 with ``Retry-After``. Until the router's pick it holds a *reservation* on every rank it
  was allowed on, so a burst of new sessions cannot all take the same last room.
- A session quiet for longer than ``release_factor`` x its own longest think gap (``config``) is
  *reclaimable*: it keeps counting while nobody needs the room, but a new session that finds room
  only once it goes releases it. A released session that comes back is a new session.
- A client key's ``max_sessions`` caps its active sessions (429 at once: waiting would not help).

Reads (``count``) change nothing; ``refresh`` (on the admission path and a timer) applies what time
changed: expired reservations, ended sessions' peaks for the growth model, pool overruns logged.
The queue is per replica; with Redis the replicas share the session table, not the queue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from proxy.admission.accounting import RankState, Reservation, count, log_over_pool
from proxy.admission.config import TYPICAL_GAP_QUANTILE, AdmissionConfig
from proxy.admission.growth import PeakEstimator
from proxy.admission.queue import WaitQueue
from proxy.admission.refusals import client_at_cap, no_room
from proxy.admission.room import Room, excess_tokens, find_room, should_move
from proxy.admission.think_gaps import ThinkGaps
from proxy.admission.weight import context_blocks, head, prompt_tokens
from proxy.context import Outcome, RequestContext
from proxy.ops.metrics import Metrics
from proxy.stages.observe import Observer
from proxy.state.sessions import Session, SessionTable
from routing.ranks import Fleet, Rank

log = logging.getLogger("prefixgate.admission")

#: Wraps a wait so that something outside admission can cancel it (the client going away).
Guard = Callable[[Awaitable[frozenset[str]]], Awaitable[frozenset[str]]]


@dataclass(frozen=True, slots=True)
class Admitted:
    """Admission's answer for one request: its session's record, and where it may go."""

    #: The session's record (None: the request has no session key, nothing is accounted).
    session: Session | None = None
    #: The ranks a new (or re-homed) session may go to; None: any.
    allowed: frozenset[str] | None = None
    #: The rank an active session is accounted on: the router keeps it there unless it is down or
    #: saturated.
    home: str | None = None


class Admission(Observer):
    """Session accounting and admission control, and the session updates after routing."""

    def __init__(
        self, table: SessionTable, fleet: Fleet, config: AdmissionConfig, metrics: Metrics | None = None
    ) -> None:
        self.table = table
        self.fleet = fleet
        self.config = config
        self.metrics = metrics
        self.queue = WaitQueue(config.poll_interval)
        self._reservations: dict[str, Reservation] = {}
        self._over_pool: set[str] = set()
        #: Peaks of the sessions that ended (idled out or deleted): how far sessions grow.
        self.peaks = PeakEstimator()
        #: Every session's think gaps: the stand-in for a session that has shown few of its own.
        self.think_gaps = ThinkGaps()
        #: Active sessions at the last refresh and their context: one missing next time has ended.
        self._live: dict[str, int] = {}
        #: Each rank's working set at the last refresh, kept current as sessions grow and move: a
        #: session's turn checks its rank against it before counting everything again.
        self._last_working_set: dict[str, int] = {}

    # -- stage 5 ----------------------------------------------------------------------------------

    async def admit(self, ctx: RequestContext, guard: Guard | None = None) -> Admitted:
        """Where ``ctx`` may go, once it may proceed. Only a new session that finds no room waits,
        in the queue, through ``guard`` (the pipeline's: cancel the wait when the client leaves; a
        cancelled waiter leaves the queue and nothing was counted for it); otherwise this returns
        without waiting.

        Raises ``ProxyError(429)`` when the client is at its session cap, or when no rank had room
        within the admission wait.
        """
        key = ctx.session_key
        if key is None:
            return Admitted()
        now = self.table.clock()
        tokens = prompt_tokens(ctx)
        session = self.table.get(key)
        head_key, head_tokens = head(ctx)
        if session is not None and session.is_active(now, self.config.idle_ttl):
            self._note_gap(session.note_request(now))
            old_tokens = session.context_tokens
            if session.client is None:
                session.client = ctx.client_label
            self._take_turn(ctx, session, tokens, head_key, head_tokens)
            if not self.config.enabled:
                return Admitted(session)
            allowed = self._rehome(session, old_tokens, head_key, head_tokens)
            # admitted where it is: the router keeps it there
            return Admitted(session, allowed, session.rank if allowed is None else None)
        if session is None:
            session = Session(key=key, created=now, last_seen=now, client=ctx.client_label)
        else:
            self._note_gap(session.note_request(now))  # back after ending: one of its think times too
        allowed = None
        if self.config.enabled:
            client = ctx.client
            if client is not None and client.max_sessions is not None:
                refused = client_at_cap(
                    client.label, client.max_sessions, self.table.active(now), now, self.config.idle_ttl
                )
                if refused is not None:
                    self._rejected("client_sessions")
                    raise refused
            allowed = await self._wait_for_room(key, tokens, head_key, head_tokens, guard)
        session.released = False
        session.last_seen = self.table.clock()
        session.rank = None  # back after idling out: wherever the router now sends it
        self._take_turn(ctx, session, tokens, head_key, head_tokens)
        return Admitted(session, allowed)

    def _take_turn(
        self, ctx: RequestContext, session: Session, tokens: int, head_key: str | None, head_tokens: int
    ) -> None:
        """``ctx`` is ``session``'s next turn: its context is now this prompt of ``tokens``."""
        session.head_key, session.head_tokens = head_key, head_tokens
        session.turns += 1
        session.context_tokens = tokens
        session.context_blocks = context_blocks(ctx, tokens, self.config.block_size)
        self.table.save(session)

    def _note_gap(self, gap: float | None) -> None:
        if gap is not None:
            self.think_gaps.add(gap)

    def typical_gap(self) -> float | None:
        """A long think gap across sessions (their 95th percentile), once enough are known."""
        return self.think_gaps.quantile(TYPICAL_GAP_QUANTILE)

    def _rehome(
        self, session: Session, old_tokens: int, head_key: str | None, head_tokens: int
    ) -> frozenset[str] | None:
        """The ranks with room to move ``session`` to, when its rank's sessions have outgrown its pool
        and ``session`` is the one to go (``room.should_move``); None: it stays. Only to a rank with
        room for its projected size as it stands (nobody is released for a move)."""
        rank = self.fleet.get(session.rank) if session.rank is not None else None
        if rank is None or not rank.pool_tokens:
            return None
        last = self._track(rank.name, session.context_tokens - old_tokens)
        if last is not None and last <= rank.pool_tokens:
            return None  # the cheap check (an over-estimate: shared heads count in full)
        states = self.refresh()
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
        return self._reserve(session.key, Room(allowed), self.projected(session.context_tokens))

    def _track(self, rank: str, delta: int) -> int | None:
        """Keep the last count of ``rank``'s working set current between full counts as its sessions
        grow, arrive and leave; its new value (None before the first count)."""
        last = self._last_working_set.get(rank)
        if last is None:
            return None
        last = self._last_working_set[rank] = last + delta
        return last

    async def _wait_for_room(
        self, key: str, tokens: int, head_key: str | None, head_tokens: int, guard: Guard | None
    ) -> frozenset[str] | None:
        """The ranks with room for a new session of ``tokens``, waiting FIFO up to ``wait`` seconds."""
        if not self.fleet.healthy():
            return None  # the router answers 503: waiting for room would not bring a rank back
        need = self.projected(tokens)

        def attempt() -> frozenset[str] | None:
            room = self._room(tokens, head_key, head_tokens, self.refresh())
            return self._reserve(key, room, need) if room.allowed else None

        if not len(self.queue):
            found = attempt()
            if found is not None:
                return found
        if self.metrics is not None:
            self.metrics.admission_queued.inc()
        waiting = self.queue.wait(attempt, self.config.wait, self._set_queue_depth)
        try:
            return await (guard(waiting) if guard is not None else waiting)
        except TimeoutError:
            reason, refused = no_room(tokens, self.count(), self.config, self.table.clock())
            self._rejected(reason)
            raise refused from None

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

    def _reserve(self, key: str, room: Room, tokens: int) -> frozenset[str]:
        # in the same step as the room check: the next waiter must see this session's claim
        self._reservations[key] = Reservation(room.allowed, tokens, room.victims)
        return room.allowed

    def reservation(self, key: str) -> Reservation | None:
        """The session's pending claim on room (between its room check and its rank's pick)."""
        return self._reservations.get(key)

    # -- accounting -------------------------------------------------------------------------------

    def count(self, now: float | None = None) -> dict[str, RankState]:
        """Working set and session count per rank (a read: changes nothing)."""
        now = self.table.clock() if now is None else now
        return count(
            self.fleet,
            self.table.active(now),
            self._reservations.values(),
            self.config,
            now,
            self.peaks.expected_peak,
            self.typical_gap(),
        )

    def refresh(self, now: float | None = None) -> dict[str, RankState]:
        """Apply what time changed (expired reservations, sessions that ended, pools overrun) and
        return the count."""
        now = self.table.clock() if now is None else now
        self._expire_reservations()
        active = self.table.active(now)
        self._note_ended({session.key: session.context_tokens for session in active})
        states = count(
            self.fleet,
            active,
            self._reservations.values(),
            self.config,
            now,
            self.peaks.expected_peak,
            self.typical_gap(),
        )
        self._last_working_set = {name: state.working_set_tokens for name, state in states.items()}
        log_over_pool(states, self._over_pool)
        return states

    def projected(self, tokens: int) -> int:
        """The room a session of ``tokens`` needs: as large as sessions of its size grew before ending."""
        return self.peaks.expected_peak(tokens)

    def _note_ended(self, live: dict[str, int]) -> None:
        """Sessions active at the last refresh and not now have ended: their last context is their
        peak (unless admission released them: cut short, they may come back and grow on)."""
        for key, tokens in self._live.items():
            if key not in live:
                ended = self.table.get(key)
                if ended is None or not ended.released:
                    self.peaks.add(tokens)
        self._live = live

    def _expire_reservations(self) -> None:
        now = time.monotonic()
        for key in [k for k, r in self._reservations.items() if not r.live(now)]:
            del self._reservations[key]

    # -- after routing and after the answer -------------------------------------------------------

    def placed(self, ctx: RequestContext, rank: Rank) -> None:
        """The router sent the admitted request to ``rank``: its reservation becomes the session's
        place there (releasing the ended sessions it was counted against, if any)."""
        session = ctx.admitted.session if ctx.admitted is not None else None
        if session is None:
            return
        reservation = self._reservations.pop(session.key, None)
        if reservation is not None and reservation.victims.get(rank.name):
            self._release_idle(rank.name, reservation.victims[rank.name], session.key)
        self._move(session, rank.name)

    def _move(self, session: Session, rank: str) -> None:
        if session.rank != rank:
            if session.rank is not None:
                self._track(session.rank, -session.context_tokens)
            self._track(rank, session.context_tokens)
            session.rank = rank
            self.table.save(session)

    def finished(self, outcome: Outcome) -> None:
        """The rank answered: the session's counters, its context after the answer."""
        admitted = outcome.ctx.admitted
        session = admitted.session if admitted is not None else None
        if session is None or not outcome.answered or outcome.rank is None:
            return
        self._move(session, outcome.rank)  # a retry may have answered elsewhere
        session.last_seen = max(session.last_seen, self.table.clock())
        estimated = outcome.ctx.estimated_cached_tokens
        if estimated is not None:
            session.hit_tokens_estimated += estimated
        usage = outcome.usage
        if usage is not None:
            cached = usage.cached_tokens or 0
            session.prompt_tokens_sent += usage.prompt_tokens
            session.hit_tokens_reported += cached
            session.prefill_tokens += usage.prompt_tokens - cached
            # the next turn re-sends this prompt and the answer: that is what the rank now holds
            context = usage.prompt_tokens + usage.completion_tokens
            self._track(outcome.rank, context - session.context_tokens)
            session.context_tokens = context
            session.context_blocks = -(-session.context_tokens // self.config.block_size)
        session.answered_at = session.last_seen
        self.table.save(session)
        self.queue.notify()

    def release(self, key: str) -> Session | None:
        """End a session at once (``DELETE /admin/sessions/{id}``): its budget is free for the queue."""
        self._reservations.pop(key, None)
        session = self.table.delete(key)
        self.queue.notify()
        return session

    def _release_idle(self, rank: str, keys: tuple[str, ...], for_key: str) -> None:
        """End sessions the new session ``for_key`` took the room of (unless they came back since)."""
        now = self.table.clock()
        typical = self.typical_gap()
        for key in keys:
            session = self.table.get(key)
            if session is None or session.released or session.rank != rank or not session.answered:
                continue
            if now - session.answered_at <= self.config.release_after(session, typical):
                continue  # it sent a request since the room check
            session.released = True
            self.table.save(session)
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

    # -- metrics and logs -------------------------------------------------------------------------

    def _rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.admission_rejected.labels(reason).inc()

    def _set_queue_depth(self, depth: int) -> None:
        if self.metrics is not None:
            self.metrics.admission_queue_depth.set(depth)
