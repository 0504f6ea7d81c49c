"""Stage 5, admit: each rank's KV budget is a set of seats, and sessions take turns in them.

The whole rule:

- A rank's budget is ``target_fraction`` (1.0) of its KV pool; on a rank that offloads KV to CPU memory,
  of its GPU pool plus its CPU tier, whose size is learned from the rank's KV events (full at its
  first eviction: the size is what it held just before; each replica learns it from the same events,
  ``routing/kv_events.py``). Until an offloading rank has shown its CPU tier's size, its budget does
  not bind (the tier is taken as large enough). A session holds a seat on one rank: its
  working set (its context, projected as sessions of its size grew; a head its rank already holds
  counts once) counts against that budget while it is active.
- A seated session's turns are always admitted, on its rank (``Admitted.home``). When a rank's
  sessions grow past what it holds, its quiet ones are parked, the quiet longest first, until it
  holds the rest (``_park_past_pool``), unless the growing session's own turn moves it to a rank
  with room.
- A new session, or one coming back after it was parked or ended, takes a seat where the budget
  has room, or room once sessions quiet past their own think times (judged ended) give up theirs.
- Else it waits, in order: priority, then fair across client keys, then arrival (``queue.py``). It
  is never refused for lack of room; the client is told nothing until it is seated. A waiter
  behind the first takes room the first cannot use (a smaller session where a larger one does not
  fit); only the first rotates a seat to itself.
- **Rotation.** Once a waiter has waited the rotation bound, quiet residents are parked for it
  (``rotation.py``: quiet longest since their last answer first, then the most service). On a rank
  that offloads KV to CPU memory parking costs a reload, not a recompute: rotation prefers it, and
  a waiter coming back to its own blocks there does not wait the bound (the seat it takes must have
  been held one), nor takes room on another rank (which would recompute its whole context) while a
  quiet session there can be parked. Parking
  gives up the seat and leaves the blocks to age out of the rank's cache; the session's next turn
  waits for a seat like a newcomer's. A seat is not taken back before it has served one answer (so
  seats do not flap).
- The rotation bound is learned from the traffic: ``WAIT_REQUESTS`` long requests' durations
  (``learned.py``), so a replay compressed 100x gets a bound 100x shorter; ``--admission-wait`` sets
  it in seconds. A session quiet past twice its own longest think gap has most likely ended and
  gives up its seat to a waiter at once, without a rotation.
- 429 only for a client key's ``max_sessions`` and a queue longer than ``--admission-queue``, with
  Retry-After; 400 at once for a prompt larger than any rank can hold.
- A request that fails releases what was counted for it; ``DELETE /admin/sessions/{id}`` frees a
  seat at once.

Reads (``count``) change nothing; ``refresh`` (on the admission path and a timer) applies what time
changed: expired reservations, ended sessions, the learned idle TTL, pool overruns parked. Until the
router's pick, a seated session holds a *reservation* on the ranks it was allowed, so a
burst of new sessions cannot all take the same last room. With Redis the replicas share the session
table and the claims on room (``proxy/state/redis/claims.py``): a reservation is checked against
every replica's claims and taken in one atomic step; each replica's waiters stand in its own queue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

from proxy.admission.accounting import RankState, Reservation, budget_tokens, count, log_over_pool
from proxy.admission.config import BYTES_PER_TOKEN, RESERVATION_TTL_S, AdmissionConfig
from proxy.admission.learned import LearnedTime, PeakEstimator, RankSpeeds, poll_interval
from proxy.admission.queue import Ticket, WaitQueue
from proxy.admission.refusals import client_at_cap, context_too_long, queue_full
from proxy.admission.room import Room, excess_tokens, find_room, should_move
from proxy.admission.rotation import Parking, choose_parked, past_pool, reloads_own, why_none
from proxy.apis.base import Usage
from proxy.context import Admitted, Before, Outcome, RequestContext, Seat
from proxy.errors import CLIENT_CLOSED
from proxy.ops.metrics import Metrics
from proxy.state.claims import Ask, LocalClaims, RoomClaims
from proxy.state.sessions import Session, SessionTable
from proxy.tenants import shown_to
from routing.rank_metrics import RankSample
from routing.ranks import Fleet, Rank

__all__ = ["Admission", "Guard", "Placement"]

log = logging.getLogger("prefixgate.admission")

#: Wraps a wait so that something outside admission can cancel it (the client going away).
Guard = Callable[[Awaitable[Seat]], Awaitable[Seat]]

#: Think-gap counts and answer times kept for sessions no longer active, so that one coming back is
#: not counted from zero again (the least recently seen go first).
GAP_COUNTS_KEPT = 10_000


class Placement(Protocol):
    """What admission reads of routing: the prefix index and the prefill queued per rank."""

    def holds(self, block_hashes: Sequence[bytes]) -> dict[str, int]: ...

    def queued(self, rank: str) -> int: ...


class Admission:
    """Session accounting and admission control: the decision for each request (stage 5, ``admit``),
    the count it is made on, and what routing, the answers and time change about it."""

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
        #: Each rank's working set at the last full count, kept current as sessions grow and move,
        #: so a session's turn checks its rank against it before counting everything again.
        self._last_working_set: dict[str, int] = {}
        #: The last refresh's count, with the queue's change count and the time it was made at.
        self._recent: tuple[int, float, dict[str, RankState]] | None = None

    def typical_gap(self) -> float | None:
        """A long think gap across sessions (their 95th percentile), once enough are known."""
        return self.time.typical_gap()

    def release_after(self, session: Session) -> float:
        """Quiet seconds after its last answer from which ``session`` has most likely ended
        (``learned.release_after``'s think-gap rule)."""
        return self.time.release_rule()(session)

    def poll_interval(self) -> float:
        return poll_interval(self.time.idle_ttl())

    def clocks(self) -> dict[str, float | bool | None]:
        """The clocks in force and whether the traffic taught them (a read, for ``/metrics`` and the
        dashboard)."""
        return {
            "idle_ttl_s": self.time.idle_ttl(),
            "wait_bound_s": self.time.wait_bound(),
            "learned": self.time.learned(),
        }

    # -- stage 5 ----------------------------------------------------------------------------------

    async def admit(self, ctx: RequestContext, guard: Guard | None = None) -> Admitted:
        """Where ``ctx`` may go, once it may proceed. Only a session without a seat that finds no
        room waits, in the queue, through ``guard`` (the pipeline's: cancel the wait when the client
        leaves; a cancelled waiter leaves the queue and nothing was counted for it).

        Raises ``ProxyError``: 400 for a prompt no rank can hold; 429 when the client is at its
        session cap, or the queue is full.
        """
        tokens = prompt_tokens(ctx)
        if self.config.enabled and ctx.landing is None:  # an estimate (``ctx.landing``): the rank judges
            self._check_fits(ctx.prompt_tokens)
        key = ctx.session_key
        if key is None:
            return Admitted()
        now = self.table.clock()
        session = self.table.get(key, breaks=False)
        head_key, head_tokens = head(ctx)
        if session is not None and session.is_active(now, self.time.idle_ttl()):
            return self._next_turn(ctx, session, now, tokens, head_key, head_tokens)
        before = Before.of(session) if session is not None else None
        if session is None:
            session = Session(key=key, created=now, last_seen=now, client=ctx.client_label)
        else:
            session.note_request(now)  # back after parking or ending: one of its think times too
            session.rank = None  # counted nowhere until seated again
        seat: Seat | None = None
        waited = 0.0
        if self.config.enabled:
            client = ctx.client
            if client is not None:
                self._weights[client.label] = client.weight
                if client.max_sessions is not None:
                    refused = client_at_cap(
                        client.label,
                        client.max_sessions,
                        self.table.active(now),
                        now,
                        self.time.idle_ttl(),
                        key,
                    )
                    if refused is not None:
                        self._rejected("client_sessions")
                        raise refused
            seat, waited, late = await self._wait_for_seat(ctx, tokens, head_key, head_tokens, guard)
            self._explain(session, seat, waited, before is not None and before.released, late)
        session.released = False
        session.priority = ctx.priority
        session.last_seen = session.seated_at = self.table.clock()
        take_turn(ctx, session, tokens, head_key, head_tokens, self.config.block_size)
        self.table.save(session)
        allowed = seat.allowed if seat is not None else None
        return Admitted(session, allowed, None, before, True, seat, waited)

    def _next_turn(
        self,
        ctx: RequestContext,
        session: Session,
        now: float,
        tokens: int,
        head_key: str | None,
        head_tokens: int,
    ) -> Admitted:
        """A seated session's next turn: admitted at once, homed on its rank, unless its rank's
        sessions outgrew the pool and it is the one to move (``_rehome``)."""
        before = Before.of(session)
        session.note_request(now)
        if session.client is None:
            session.client = ctx.client_label
        take_turn(ctx, session, tokens, head_key, head_tokens, self.config.block_size)
        self.table.save(session)
        if not self.config.enabled:
            return Admitted(session, before=before)
        allowed = self._rehome(session, before.context_tokens, head_key, head_tokens)
        return Admitted(session, allowed, session.rank if allowed is None else None, before=before)

    def _check_fits(self, tokens: int | None) -> None:
        """400 at once for a prompt larger than every healthy rank's context length and pool."""
        if tokens is None:
            return
        limits = [
            min(n for n in (rank.max_model_len, rank.pool_tokens) if n)
            for rank in self.fleet.healthy()
            if rank.max_model_len or rank.pool_tokens
        ]
        if limits and tokens >= max(limits):
            self._rejected("context_length")
            raise context_too_long(tokens, max(limits))

    def _explain(
        self, session: Session, seat: Seat | None, waited: float, returning: bool, late: str
    ) -> None:
        """The decision, said: the record ``/admin/sessions/{id}`` and the dashboard show (its rank
        added once placed: ``_say_placed``), and the metrics counted for it (``late``: why no seat
        came sooner, for a seat given past the rotation bound)."""
        if seat is not None:
            decision, reason = seat.decision, seat.reason
        else:
            decision, reason = "room", "no healthy rank to weigh: the router decides"
        session.admission = {
            "at": self.table.clock(),
            "decision": decision,
            "reason": reason,
            "resumed": returning,
            "waited_s": round(waited, 4),
            "wait_bound_s": round(self.time.wait_bound(), 4),
            "idle_ttl_s": round(self.time.idle_ttl(), 4),
            "allowed": sorted(seat.allowed) if seat is not None else None,
            "parked": [shown_to(key, session.client).removeprefix("session ") for key in seat.parked]
            if seat
            else [],
            "rank": None,
        }
        metrics = self.metrics
        if metrics is not None:
            metrics.admission_decisions.labels(decision).inc()
            if returning:
                metrics.admission_resumed.inc()
            if waited > 0:
                metrics.admission_wait.observe(waited)
                # a rotation seats the first waiter at the bound, seen within one poll interval
                if waited > self.time.wait_bound() + self.poll_interval():
                    metrics.admission_waits_past_bound.labels(late).inc()

    async def _wait_for_seat(
        self, ctx: RequestContext, tokens: int, head_key: str | None, head_tokens: int, guard: Guard | None
    ) -> tuple[Seat | None, float, str]:
        """The seat for a session of ``tokens``, waiting in the queue for one (rotating a seat to it
        once it has waited the bound); the seconds waited; and why no seat came sooner past the
        bound (``rotation.why_none``, or ``behind``: another waiter was first)."""
        if not self.fleet.healthy():
            return None, 0.0, ""  # the router answers 503: waiting for room would not bring a rank back
        key = ctx.session_key
        assert key is not None
        limit = self.config.max_queue
        if limit is not None and len(self.queue) >= limit:
            self._rejected("queue_full")
            raise queue_full(len(self.queue), self.time.wait_bound())
        need = self.projected(tokens)
        hits = self.placement.holds(ctx.block_hashes) if self.placement and ctx.block_hashes else {}
        started = time.monotonic()
        client = ctx.client
        ticket = Ticket(client.label, ctx.priority, client.weight) if client is not None else Ticket()

        blocked = "behind"  # why its last look past the bound found no seat (``_explain``)

        def attempt(first: bool = True) -> Seat | None:
            """The seat now, if one can be had. ``first``: nobody waits ahead of this session, so
            past the bound a seat may rotate to it; behind others it takes only room they cannot use
            (on the count they made, while nothing has changed: every waiter checks on every wake)."""
            nonlocal blocked
            states = self.refresh() if first else self._recent_count()
            room = self._room(tokens, head_key, head_tokens, states)
            waited = time.monotonic() - started
            bound = self.time.wait_bound()
            if not first:
                if waited >= bound:
                    blocked = "behind"
                return self._seat(key, room, need, head_key, head_tokens) if room.allowed else None
            parking: Parking | None = None
            # Its own context waits in a CPU tier where there is no room: a quiet session parked there
            # costs a reload, room elsewhere a recompute of its whole context.
            own = [r for r in self.fleet.healthy() if r.offloads_kv and reloads_own(r, hits, head_tokens)]
            if own and not room.allowed & {r.name for r in own}:
                parking = self._rotation(states, need, head_key, head_tokens, hits, waited, ctx.priority, own)
            if parking is None and not room.allowed:
                parking = self._rotation(states, need, head_key, head_tokens, hits, waited, ctx.priority)
                if parking is None and waited >= bound:
                    blocked = why_none(states, self.table.clock())
            if parking is not None:
                self._park(parking, f"which had waited {time.monotonic() - started:.3f} s", key)
                room = self._room(tokens, head_key, head_tokens, self.refresh())
                if parking.rank in room.allowed:  # the rank it parked on: where its own blocks are
                    victims = {name: keys for name, keys in room.victims.items() if name == parking.rank}
                    room = Room(frozenset({parking.rank}), victims)
            if not room.allowed:
                return None
            return self._seat(key, room, need, head_key, head_tokens, parking)

        alone = len(self.queue) == 0
        found = attempt() if alone else None  # else it looks from its place in line
        if found is not None:
            return found, 0.0, ""
        if self.metrics is not None:
            self.metrics.admission_queued.inc()
        waiting = self.queue.wait(
            attempt, self._set_queue_depth, ticket, lambda seat: self._abandon(key), looked=alone
        )
        seat = await (guard(waiting) if guard is not None else waiting)
        return seat, time.monotonic() - started, blocked

    def _seat(
        self,
        key: str,
        room: Room,
        need: int,
        head_key: str | None,
        head_tokens: int,
        parking: Parking | None = None,
    ) -> Seat | None:
        """The seat ``room`` gives session ``key`` once reserved (None: another replica took it)."""
        granted = self._reserve(key, room, need, head_key, head_tokens)
        if not granted:
            return None
        victims = {name: keys for name, keys in room.victims.items() if name in granted}
        if parking is not None:
            return Seat("rotated", granted, victims, parking.rank, parking.keys)
        return Seat("released" if victims else "room", granted, victims)

    def _abandon(self, key: str) -> None:
        """Session ``key``'s client left once a seat was found for it, before it took it: what was
        reserved for it is free again."""
        self._reservations.pop(key, None)
        self._recent = None
        self.claims.release(key)

    def _rotation(
        self,
        states: dict[str, RankState],
        need: int,
        head_key: str | None,
        head_tokens: int,
        hits: dict[str, int],
        waited: float,
        priority: int,
        ranks: Sequence[Rank] | None = None,
    ) -> Parking | None:
        """The residents to park for a waiter that has waited ``waited`` seconds, on ``ranks`` (None:
        the healthy ranks) (``rotation.choose_parked``)."""
        bound = self.time.wait_bound()

        return choose_parked(
            self.fleet.healthy() if ranks is None else ranks,
            states,
            need,
            head_key,
            head_tokens,
            self.config.max_sessions_per_rank,
            self.table.clock(),
            waited,
            priority,
            bound,
            self.poll_interval(),
            hits,
            lambda label: self._weights.get(label or "", 1.0),
        )

    def _park(self, parking: Parking, why: str, for_key: str | None = None) -> None:
        """Park ``parking``'s sessions (``why``; ``for_key``: the waiter they are parked for, whose
        client alone may see its name): each gives up its seat (its claim released at once, so every
        replica sees the room), its blocks left to the rank's LRU."""
        now = self.table.clock()
        for key in parking.keys:
            session = self.table.get(key, breaks=False)
            if session is None or session.released or session.rank != parking.rank or not session.answered:
                continue  # it ended, moved or sent a request since the count
            session.released = True
            session.parks += 1
            quiet = now - session.answered_at
            waiter = f"for {shown_to(for_key, session.client)}, " if for_key is not None else ""
            reason = f"parked {waiter}{why}; quiet {quiet:.3f} s"
            session.admission = {
                **(session.admission or {}),
                "decision": "parked",
                "reason": reason,
                "at": now,
            }
            self.table.save(session)
            self.claims.release(key)
            if self.metrics is not None:
                self.metrics.admission_parked.labels(
                    parking.rank, "pool" if for_key is None else "waiter"
                ).inc()
            log.info("session %s parked on %s after %d turns: %s", key, parking.rank, session.turns, reason)

    # -- room and reservations ------------------------------------------------------------------

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
            self._recent = None  # the next waiter counts this session's claim
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

    def refresh(self, now: float | None = None, *, park: bool = True) -> dict[str, RankState]:
        """Apply what time changed (expired reservations, sessions that ended, the learned idle TTL,
        pools overrun: ``park``, their quiet sessions parked) and return the count."""
        now = self.table.clock() if now is None else now
        self._expire_reservations()
        self.table.set_idle_ttl(self.time.idle_ttl())
        self.queue.poll_interval = self.poll_interval()
        active = self.table.active(now)
        self._learn(active)
        self._note_ended({session.key: session.context_tokens for session in active})
        states = self._count(active, now)
        if park and self.config.enabled and self._park_past_pool(states, now):
            states = self._count(self.table.active(now), now)
        self._counted(states)
        log_over_pool(states, self._over_pool)
        self._recent = (self.queue.changes, time.monotonic(), states)
        return states

    def _park_past_pool(self, states: dict[str, RankState], now: float) -> bool:
        """Park the sessions ``rotation.past_pool`` names on each rank whose seated sessions grew
        past what it holds (else they evict each other's blocks at every turn). Whether any was."""
        parked = False
        for state in states.values():
            if excess_tokens(state) <= 0:
                continue  # within what it holds, as at nearly every refresh
            keys = past_pool(state, now)
            if keys:
                self._park(Parking(state.name, keys), f"as the sessions on {state.name} outgrew its pool")
                parked = True
        return parked

    def _recent_count(self) -> dict[str, RankState]:
        """The last refresh's count while nothing that wakes the queue or takes room has happened
        since, for at most one poll interval (what time changes); else a refresh. Every waiter behind
        the first checks for room on every wake: one count serves them all."""
        recent = self._recent
        if recent is not None:
            changes, at, states = recent
            if changes == self.queue.changes and time.monotonic() - at < self.queue.poll_interval:
                return states
        return self.refresh()

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

    # -- sessions moving between ranks -------------------------------------------------------------

    def _counted(self, states: dict[str, RankState]) -> None:
        """A full count happened: the tracked working sets start from it."""
        self._last_working_set = {name: state.working_set_tokens for name, state in states.items()}

    def _forget_counts(self) -> None:
        """The tracked working sets are off (a failed request was undone): count again next time."""
        self._last_working_set = {}

    def _track(self, rank: str, delta: int) -> int | None:
        """Keep the last count of ``rank``'s working set current between full counts as its sessions
        grow, arrive and leave; its new value (None before the first count)."""
        last = self._last_working_set.get(rank)
        if last is None:
            return None
        last = self._last_working_set[rank] = last + delta
        return last

    def _move(self, session: Session, rank: str) -> None:
        """``session`` is on ``rank`` now (placed there, or a retry answered there)."""
        if session.rank != rank:
            if session.rank is not None:
                self._track(session.rank, -session.context_tokens)
            self._track(rank, session.context_tokens)
            session.rank = rank
            self.table.save(session)

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
        # not parking: a move to a rank with room recomputes the smallest context that ends the
        # overrun, parking a quiet session there would leave the largest to recompute
        states = self.refresh(park=False)
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
        granted = self._reserve(session.key, Room(allowed), self.projected(session.context_tokens))
        return granted or None

    def _release_idle(self, rank: str, keys: tuple[str, ...], for_key: str) -> None:
        """End sessions the new session ``for_key`` took the room of (unless they came back since)."""
        table = self.table
        now = table.clock()
        for key in keys:
            session = table.get(key, breaks=False)
            if session is None or session.released or session.rank != rank or not session.answered:
                continue
            if now - session.answered_at <= self.release_after(session):
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
            self._release_idle(rank.name, victims, session.key)
            for victim in victims:
                released = self.table.get(victim, breaks=False)
                if released is not None and released.released:
                    self.claims.release(victim)
        if admitted.fresh:
            _say_placed(session, rank.name)
        moved = session.rank != rank.name
        self._move(session, rank.name)
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
        self._move(session, rank)  # a retry may have answered elsewhere
        session.last_seen = max(session.last_seen, self.table.clock())
        estimated = outcome.ctx.estimated_cached_tokens
        if estimated is not None:
            session.hit_tokens_estimated += estimated
        usage = outcome.usage
        if usage is not None:
            self._track(rank, settle(session, usage, self.config.block_size))
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
        self._forget_counts()
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


# -- what a turn weighs --------------------------------------------------------------------------


def prompt_tokens(ctx: RequestContext) -> int:
    """The prompt's tokens; estimated from the body without a count (policies that need no blocks)."""
    if ctx.prompt_tokens is not None:
        return ctx.prompt_tokens
    return len(ctx.raw_body) // BYTES_PER_TOKEN


def head(ctx: RequestContext) -> tuple[str | None, int]:
    """The prompt's head (``PromptBlocks.head``: the system+tools segment sessions of one agent
    share, which a rank caches once whatever its sessions), or (None, 0)."""
    blocks = ctx.prompt_blocks
    return blocks.head() if blocks is not None else (None, 0)


def context_blocks(ctx: RequestContext, tokens: int, block_size: int) -> int:
    """Blocks of a context of ``tokens``: the prompt's own hash count when it is this prompt."""
    if ctx.block_hashes and tokens == ctx.prompt_tokens:
        return len(ctx.block_hashes)
    return -(-tokens // block_size)


def take_turn(
    ctx: RequestContext,
    session: Session,
    tokens: int,
    head_key: str | None,
    head_tokens: int,
    block_size: int,
) -> None:
    """``ctx`` is ``session``'s next turn: its context is now this prompt of ``tokens``."""
    session.head_key, session.head_tokens = head_key, head_tokens
    session.turns += 1
    session.context_tokens = tokens
    session.context_blocks = context_blocks(ctx, tokens, block_size)


def settle(session: Session, usage: Usage, block_size: int) -> int:
    """The rank answered with ``usage``: count it; the session's context is now the prompt and the
    answer (what the next turn re-sends, and what the rank holds). Returns the context's change."""
    cached = usage.cached_tokens or 0
    session.prompt_tokens_sent += usage.prompt_tokens
    session.hit_tokens_reported += cached
    session.prefill_tokens += usage.prompt_tokens - cached
    context = usage.prompt_tokens + usage.completion_tokens
    delta = context - session.context_tokens
    session.context_tokens = context
    session.context_blocks = -(-context // block_size)
    return delta


def _say_placed(session: Session, rank: str) -> None:
    """The router picked ``rank`` for a session just seated: record it, and say it in one sentence
    (once the rank is known, so the line names the one it went to)."""
    record = session.admission
    if record is None or record.get("rank") is not None:
        return
    record["rank"] = rank
    if log.isEnabledFor(logging.INFO):
        log.info(
            "session %s %s on %s after waiting %.3f s (rotation bound %.3g s): %s",
            session.key,
            "resumed" if record.get("resumed") else "seated",
            rank,
            record.get("waited_s", 0.0),
            record.get("wait_bound_s") or 0.0,
            record.get("reason"),
        )
