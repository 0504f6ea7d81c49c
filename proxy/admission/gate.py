"""Stage 5, admit: each rank's KV budget is a set of seats, and sessions take turns in them.

The whole rule:

- A rank's budget is ``target_fraction`` of its KV pool; on a rank that offloads KV to CPU memory,
  of its GPU pool plus its CPU tier, whose size is learned from the rank's KV events (full at its
  first eviction: the size is what it held just before; each replica learns it from the same events,
  ``routing/kv_events.py``). Until an offloading rank has shown its CPU tier's size, its budget does
  not bind (the tier is taken as large enough). A session holds a seat on one rank: its
  working set (its context, projected as sessions of its size grew; a head its rank already holds
  counts once) counts against that budget while it is active.
- A seated session's turns are always admitted, on its rank (``Admitted.home``).
- A new session, or one coming back after it was parked or ended, takes a seat where the budget
  has room, or room once sessions quiet past their own think times (judged ended) give up theirs.
- Else it waits, in order: priority, then fair across client keys, then arrival (``queue.py``). It
  is never refused for lack of room; the client is told nothing until it is seated.
- **Rotation.** Once a waiter has waited the rotation bound, quiet residents are parked for it
  (``rotation.py``: quiet longest since their last answer first, then the most service). On a rank
  that offloads KV to CPU memory parking costs a reload, not a recompute: rotation prefers it, and
  a waiter coming back to its own blocks there does not wait the bound (the seat it takes must have
  been held one), nor takes room on another rank (which would recompute its whole context) while a
  quiet session there can be parked. Parking
  gives up the seat and leaves the blocks to age out of the rank's cache; the session's next turn
  waits for a seat like a newcomer's. A seat is not taken back before it has served one answer and
  been held one bound (so seats do not flap).
- The rotation bound is learned from the traffic: ``WAIT_REQUESTS`` long requests' durations
  (``timing.py``), so a replay compressed 100x gets a bound 100x shorter; ``--admission-wait`` sets
  it in seconds. A session quiet past twice its own longest think gap has most likely ended and
  gives up its seat to a waiter at once, without a rotation.
- 429 only for a client key's ``max_sessions`` and a queue longer than ``--admission-queue``, with
  Retry-After; 400 at once for a prompt larger than any rank can hold.
- A request that fails releases what was counted for it; ``DELETE /admin/sessions/{id}`` frees a
  seat at once.

The count, the reservations and what answers and time change are the ``Ledger``'s (``ledger.py``).
Until the router's pick, a seated session holds a *reservation* on the ranks it was allowed, so a
burst of new sessions cannot all take the same last room. With Redis the replicas share the session
table and the claims on room (``proxy/state/redis/claims.py``): a reservation is checked against
every replica's claims and taken in one atomic step; each replica's waiters stand in its own queue.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from proxy.admission.accounting import RankState
from proxy.admission.explain import decision_record, note_decision, note_parked
from proxy.admission.ledger import Ledger
from proxy.admission.queue import Ticket
from proxy.admission.refusals import client_at_cap, context_too_long, queue_full
from proxy.admission.room import Room
from proxy.admission.rotation import Parking, choose_parked, reloads_own
from proxy.admission.turns import head, prompt_tokens, take_turn
from proxy.context import Admitted, Before, RequestContext, Seat
from proxy.state.sessions import Session
from proxy.tenants import shown_to
from routing.ranks import Rank

__all__ = ["Admission", "Guard"]

log = logging.getLogger("prefixgate.admission")

#: Wraps a wait so that something outside admission can cancel it (the client going away).
Guard = Callable[[Awaitable[Seat]], Awaitable[Seat]]


class Admission(Ledger):
    """Session accounting and admission control: the decisions for each request (``Ledger``: the
    count and the updates after routing)."""

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
            seat, waited = await self._wait_for_seat(ctx, tokens, head_key, head_tokens, guard)
            self._explain(session, seat, waited, before is not None and before.released)
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
        sessions outgrew the pool and it is the one to move (``Moves.rehome``)."""
        before = Before.of(session)
        session.note_request(now)
        if session.client is None:
            session.client = ctx.client_label
        take_turn(ctx, session, tokens, head_key, head_tokens, self.config.block_size)
        self.table.save(session)
        if not self.config.enabled:
            return Admitted(session, before=before)
        allowed = self.moves.rehome(session, before.context_tokens, head_key, head_tokens)
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

    def _explain(self, session: Session, seat: Seat | None, waited: float, returning: bool) -> None:
        if seat is not None:
            decision, reason = seat.decision, seat.reason
        else:
            decision, reason = "room", "no healthy rank to weigh: the router decides"
        bound = self.time.wait_bound()
        session.admission = decision_record(
            seat,
            decision,
            reason,
            at=self.table.clock(),
            waited_s=waited,
            bound_s=bound,
            idle_ttl_s=self.time.idle_ttl(),
            resumed=returning,
            owner=session.client,
        )
        note_decision(self.metrics, decision, waited, returning)

    async def _wait_for_seat(
        self, ctx: RequestContext, tokens: int, head_key: str | None, head_tokens: int, guard: Guard | None
    ) -> tuple[Seat | None, float]:
        """The seat for a session of ``tokens``, waiting in the queue for one (rotating a seat to it
        once it has waited the bound); and the seconds waited."""
        if not self.fleet.healthy():
            return None, 0.0  # the router answers 503: waiting for room would not bring a rank back
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

        def attempt(behind: bool = False) -> Seat | None:
            """The seat now, if one can be had (``behind``: others wait first, so any room is
            theirs)."""
            if behind:
                return None
            states = self.refresh()
            room = self._room(tokens, head_key, head_tokens, states)
            waited = time.monotonic() - started
            parking: Parking | None = None
            # Its own context waits in a CPU tier where there is no room: a quiet session parked there
            # costs a reload, room elsewhere a recompute of its whole context.
            own = [r for r in self.fleet.healthy() if r.offloads_kv and reloads_own(r, hits, head_tokens)]
            if own and not room.allowed & {r.name for r in own}:
                parking = self._rotation(states, need, head_key, head_tokens, hits, waited, ctx.priority, own)
            if parking is None and not room.allowed:
                parking = self._rotation(states, need, head_key, head_tokens, hits, waited, ctx.priority)
            if parking is not None:
                self._park(parking, key, time.monotonic() - started)
                room = self._room(tokens, head_key, head_tokens, self.refresh())
                if parking.rank in room.allowed:  # the rank it parked on: where its own blocks are
                    victims = {name: keys for name, keys in room.victims.items() if name == parking.rank}
                    room = Room(frozenset({parking.rank}), victims)
            if not room.allowed:
                return None
            granted = self._reserve(key, room, need, head_key, head_tokens)
            if not granted:
                return None  # another replica took that room
            victims = {name: keys for name, keys in room.victims.items() if name in granted}
            if parking is not None:
                return Seat("rotated", granted, victims, parking.rank, parking.keys)
            return Seat("released" if victims else "room", granted, victims)

        found = attempt(behind=len(self.queue) > 0)
        if found is not None:
            return found, 0.0
        if self.metrics is not None:
            self.metrics.admission_queued.inc()
        waiting = self.queue.wait(attempt, self._set_queue_depth, ticket)
        seat = await (guard(waiting) if guard is not None else waiting)
        return seat, time.monotonic() - started

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

    def _park(self, parking: Parking, for_key: str, waited: float) -> None:
        """Park ``parking``'s sessions for the waiter ``for_key``: each gives up its seat (its claim
        released at once, so every replica sees the room), its blocks left to the rank's LRU."""
        now = self.table.clock()
        for key in parking.keys:
            session = self.table.get(key, breaks=False)
            if session is None or session.released or session.rank != parking.rank or not session.answered:
                continue  # it ended, moved or sent a request since the count
            session.released = True
            session.parks += 1
            quiet = now - session.answered_at
            waiter = shown_to(for_key, session.client)
            reason = f"parked for {waiter}, which had waited {waited:.3f} s; quiet {quiet:.3f} s"
            session.admission = {
                **(session.admission or {}),
                "decision": "parked",
                "reason": reason,
                "at": now,
            }
            self.table.save(session)
            self.claims.release(key)
            note_parked(self.metrics, parking.rank)
            log.info("session %s parked on %s after %d turns: %s", key, parking.rank, session.turns, reason)
