"""Stage 5, admit: place each new session where it costs least, keep each rank's sessions within its
KV pool budget while that is worth it, and never leave a session that can run without a rank.

A rank's budget is ``pool_tokens x target_fraction``. A session's working set is its current context
(its latest prompt plus the answer); sessions seen within the idle TTL count against their rank
(``accounting.count``). The idle TTL, the wait bound and how likely a quiet session is to return are
learned from the traffic (``timing.py``); the ranks' speeds from their own metrics
(``rank_speed.py``).

- A prompt larger than any rank can hold is answered 400 (``context_length_exceeded``) at once.
- A session already active is always admitted, whatever it has grown to, and homed on its rank
  (``Admitted.home``): the router keeps it there unless that rank is down or truly saturated.
- A session back after ending whose rank still holds its blocks (per the prefix index) goes home
  at once: being idle, released or over budget never moves it by itself (``cost`` policy).
- Any other new session gets the ranks with room (``room.find_room``), or, with none, the ``cost``
  policy weighs admitting past a budget against waiting (``cost.py``); waiting is bounded, then it
  is admitted on the least costly rank. The ``budget`` policy holds the budgets: the session waits
  up to the bound, then gets 429. Waiters are served by priority, then weighted-fair across client
  keys (``queue.py``). Until the router's pick a new session holds a *reservation* on the ranks it
  was allowed, so a burst of new sessions cannot all take the same last room.
- 429 remains for a client key's ``max_sessions``, a rank's session cap, and real overload (every
  rank's prefill queue saturated).
- A request that fails (no rank answered, or the rank refused it) releases what was counted for it.

The count, the reservations and what answers and time change are the ``Ledger``'s
(``ledger.py``). With Redis the replicas share the session table and the claims on room
(``proxy/state/redis_claims.py``: a reservation is checked against every replica's claims, tokens
against the budget and sessions against ``max_sessions_per_rank``, and taken in one atomic step)
and the queue's order (``proxy/state/redis_queue.py``: room within the budgets goes to the first
waiter across replicas, checked in that same step; a session admitted at once pays no round trip
for it, and one that finds no room there takes its place in the order in that step too).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from proxy.admission.accounting import RankState
from proxy.admission.cost import Candidate, Choice, Option, choose, option, overloaded, saturated
from proxy.admission.explain import decision_record, note_decision
from proxy.admission.ledger import Admitted, Ledger, Placement
from proxy.admission.queue import Ticket
from proxy.admission.refusals import client_at_cap, context_too_long, no_room
from proxy.admission.refusals import overloaded as overload_refusal
from proxy.admission.room import Room
from proxy.admission.turns import Before, take_turn
from proxy.admission.weight import head, prompt_tokens
from proxy.context import RequestContext
from proxy.state.sessions import Session
from proxy.state.wait_order import Entry, Place

__all__ = ["Admission", "Admitted", "Guard", "Placement"]

log = logging.getLogger("prefixgate.admission")

#: Wraps a wait so that something outside admission can cancel it (the client going away).
Guard = Callable[[Awaitable[Choice]], Awaitable[Choice]]
#: A returning session goes home when its rank still holds at least this share of its context.
HOME_SHARE = 0.5


class Admission(Ledger):
    """Session accounting and admission control: the decisions for each request (``Ledger``: the
    count and the updates after routing)."""

    # -- stage 5 ----------------------------------------------------------------------------------

    async def admit(self, ctx: RequestContext, guard: Guard | None = None) -> Admitted:
        """Where ``ctx`` may go, once it may proceed. Only a new session that finds no room waits,
        in the queue, through ``guard`` (the pipeline's: cancel the wait when the client leaves; a
        cancelled waiter leaves the queue and nothing was counted for it).

        Raises ``ProxyError``: 400 for a prompt no rank can hold; 429 when the client is at its
        session cap, every rank at its session cap, every rank overloaded, or (``budget`` policy)
        no rank had room within the wait bound.
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
        old_rank = session.rank if session is not None else None
        if session is None:
            session = Session(key=key, created=now, last_seen=now, client=ctx.client_label)
        else:
            session.note_request(now)  # back after ending: one of its think times too
            session.rank = None  # counted nowhere until admitted again (home, or where it goes)
        allowed = home = choice = None
        waited = 0.0
        if self.config.enabled:
            client = ctx.client
            if client is not None and client.max_sessions is not None:
                refused = client_at_cap(
                    client.label, client.max_sessions, self.table.active(now), now, self.time.idle_ttl(), key
                )
                if refused is not None:
                    self._rejected("client_sessions")
                    raise refused
            home = self._home(ctx, old_rank, session.context_tokens, tokens)
            if home is None:
                choice, waited = await self._wait_for_room(ctx, tokens, head_key, head_tokens, guard)
                allowed = choice.allowed if choice is not None else None
            self._explain(session, choice, home, waited)
        session.released = False
        session.last_seen = self.table.clock()
        session.rank = home  # back after ending: home, or wherever the router now sends it
        take_turn(ctx, session, tokens, head_key, head_tokens, self.config.block_size)
        self.table.save(session)
        return Admitted(session, allowed, home, before, True, choice, waited)

    def _next_turn(
        self,
        ctx: RequestContext,
        session: Session,
        now: float,
        tokens: int,
        head_key: str | None,
        head_tokens: int,
    ) -> Admitted:
        """An active session's next turn: admitted where it is, homed there (the router keeps it
        there) while its rank still held at least ``HOME_SHARE`` of its context at its last turn and
        its prefill queue is not saturated (``cost.saturated``); a rank that lost it, or that is
        saturated, keeps it only as the router's load bound allows."""
        before = Before.of(session)
        session.note_request(now)
        if session.client is None:
            session.client = ctx.client_label
        take_turn(ctx, session, tokens, head_key, head_tokens, self.config.block_size)
        self.table.save(session)
        if not self.config.enabled:
            return Admitted(session, before=before)
        allowed = None
        if self.config.policy == "budget":
            allowed = self.moves.rehome(session, before.context_tokens, head_key, head_tokens)
        elif session.kept_share < HOME_SHARE or self._saturated(session.rank):
            return Admitted(session, before=before)
        return Admitted(session, allowed, session.rank if allowed is None else None, before=before)

    def _saturated(self, rank: str | None) -> bool:
        """Whether ``rank``'s prefill queue is saturated (``cost.saturated``): what is queued there
        takes many wait bounds to compute and it reports requests waiting."""
        if rank is None or self.placement is None:
            return False
        speed = self.speeds.seconds_per_token(rank)
        queue_s = self.placement.queued(rank) * speed if speed is not None else None
        return saturated(queue_s, self.speeds.load(rank).waiting, self.time.wait_bound())

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

    def _home(self, ctx: RequestContext, old_rank: str | None, context: int, tokens: int) -> str | None:
        """The rank a session back after ending goes to at once: its own (``old_rank``), while healthy
        and still holding at least ``HOME_SHARE`` of its ``context`` (``cost`` policy; else None)."""
        if self.config.policy != "cost" or old_rank is None or self.placement is None:
            return None
        rank = self.fleet.get(old_rank)
        context = min(context, tokens)
        if rank is None or not rank.healthy or not ctx.block_hashes or context <= 0:
            return None
        held = self.placement.holds(ctx.block_hashes).get(rank.name, 0) * self.config.block_size
        return rank.name if held >= HOME_SHARE * context else None

    def _explain(self, session: Session, choice: Choice | None, home: str | None, waited: float) -> None:
        if home is not None:
            decision, reason = "home", f"its rank {home} still holds its blocks"
        elif choice is not None:
            decision, reason = choice.decision, choice.reason
        else:
            decision, reason = "room", "no healthy rank to weigh: the router decides"
        session.admission = decision_record(
            choice,
            decision,
            reason,
            at=self.table.clock(),
            waited_s=waited,
            bound_s=self.time.wait_bound(),
            idle_ttl_s=self.time.idle_ttl(),
            ended_after_s=self.time.quiet_ended(),
            home=home,
        )
        note_decision(self.metrics, decision, waited)
        if log.isEnabledFor(logging.INFO):
            where = home if home is not None else ", ".join(sorted(choice.allowed)) if choice else "any"
            key, clocks = session.key, session.admission
            log.info(
                "session %s admitted (%s) after %.3f s to %s: %s (wait bound %s s, quiet sessions ended "
                "after %s s)",
                key,
                decision,
                waited,
                where,
                reason,
                clocks["wait_bound_s"],
                clocks["ended_after_s"],
            )

    async def _wait_for_room(
        self, ctx: RequestContext, tokens: int, head_key: str | None, head_tokens: int, guard: Guard | None
    ) -> tuple[Choice | None, float]:
        """The decision admitting a new session of ``tokens``, waiting in the queue while it says
        to, up to the wait bound; and the seconds waited."""
        if not self.fleet.healthy():
            return None, 0.0  # the router answers 503: waiting for room would not bring a rank back
        key = ctx.session_key
        assert key is not None
        need = self.projected(tokens)
        hits = self.placement.holds(ctx.block_hashes) if self.placement and ctx.block_hashes else {}
        bound = self.time.wait_bound()
        started = time.monotonic()
        #: When its first wait expected room (the table's clock, like the estimate): past it, the
        #: estimate failed once and the session stops waiting rather than follow one that keeps moving.
        promised: float | None = None
        client = ctx.client
        ticket = Ticket(client.label, client.priority, client.weight) if client is not None else Ticket()
        #: The place its first attempt took in the shared wait order, finding no room there.
        entered: Place | None = None

        def attempt(
            place: str | None = None, at_bound: bool = False, behind: bool = False, entry: Entry | None = None
        ) -> Choice | None:
            """The decision now, when it admits (``behind``: others wait for room first, so room
            goes to them; past a budget nobody's room is taken and the session need not queue;
            ``place``: its place in the replicas' shared wait order, while it waits there;
            ``entry``: not waiting yet, it takes a place there when the claims grant no room)."""
            nonlocal promised, entered
            states = self.refresh()
            room = self._room(tokens, head_key, head_tokens, states)
            if self.config.policy == "budget":
                why = "room within the budget"
                found = Choice(True, "room", room.allowed, room.victims, (), 0.0, 1.0, why)
                choice = found if room.allowed else None
            else:
                options = self._options(states, tokens, need, head_key, head_tokens, hits)
                now_bound = min(bound, self.time.wait_bound())  # the clocks learn while it waits
                retry = overloaded(options, now_bound) if not room.allowed else None
                if retry is not None:
                    self._rejected("overload")
                    raise overload_refusal(tokens, retry)
                clock = self.table.clock()
                waited, overdue = time.monotonic() - started, promised is not None and clock > promised
                by_lifetime = self.time.lifetimes_known()
                learned = self.time.learned()
                typical = self.time.request_seconds()  # how long a first token waits, unmeasured
                choice = choose(
                    room, options, waited, now_bound, at_bound, learned, by_lifetime, overdue, typical
                )
                if not choice.admit and by_lifetime and promised is None and choice.wait_s is not None:
                    promised = clock + choice.wait_s
            if choice is None or not choice.admit or (behind and choice.decision == "room"):
                return None
            room_taken = Room(choice.allowed, choice.victims)
            forced = choice.decision != "room"  # the cost policy chose to go past a budget
            reserved = self._reserve(
                key,
                room_taken,
                need,
                head_key,
                head_tokens,
                force=forced,
                queued=not at_bound,  # at the bound its wait is over: it takes what room there is
                place=place,
                entry=entry,
                past_budget=choice.past_budget,
            )
            granted = reserved.granted
            if not granted:
                if entry is not None:
                    entered = reserved.place
                return None  # another replica took that room, or has a waiter before this one
            if granted != choice.allowed:
                victims = {name: keys for name, keys in choice.victims.items() if name in granted}
                choice = replace(choice, allowed=granted, victims=victims)
            return choice

        found = attempt(behind=len(self.queue) > 0, entry=self.queue.entry(ticket))
        if found is not None:
            return found, 0.0
        if self.metrics is not None:
            self.metrics.admission_queued.inc()
        behind = (lambda: attempt(behind=True)) if self.config.policy == "cost" else None
        place: str | None = None

        def took_place(taken: str | None) -> None:
            nonlocal place
            place = taken

        waiting = self.queue.wait(
            lambda: attempt(place),
            bound,
            self._set_queue_depth,
            ticket,
            self.time.wait_bound,
            behind,
            took_place,
            entered,
        )
        try:
            choice = await (guard(waiting) if guard is not None else waiting)
        except TimeoutError:
            late = attempt(at_bound=True) if self.config.policy == "cost" else None
            if late is None:
                reason, refused = no_room(tokens, self.count(), self.config, self.table.clock(), bound)
                self._rejected(reason)
                raise refused from None
            choice = late
        return choice, time.monotonic() - started

    def _options(
        self,
        states: dict[str, RankState],
        tokens: int,
        need: int,
        head_key: str | None,
        head_tokens: int,
        hits: dict[str, int],
    ) -> list[Option]:
        """The cost of admitting a new session on each healthy rank below its session cap."""
        now = self.table.clock()
        request_s = self.time.request_seconds() or 0.0
        block, cap = self.config.block_size, self.config.max_sessions_per_rank
        release_after = self.time.release_rule()

        def last_activity(session: Session) -> float:
            return session.answered_at if session.answered else now + request_s

        def ends_at(session: Session) -> float:
            return last_activity(session) + release_after(session)

        def expected_end(session: Session) -> float:
            """When ``session`` will have ended: its expected remaining life at its age, then quiet
            long enough to be judged ended; never known for one older than every session seen to
            end (``LearnedTime.outlived``): no room is predicted from it."""
            age = now - session.created
            if self.time.outlived(age):
                return math.inf
            left = self.time.remaining_life(age) or 0.0
            return max(now + left, last_activity(session)) + release_after(session)

        # the same for every rank: read once per decision, not once per rank
        chance, rounds = self.time.return_probability, self.time.turns_per_session()
        last_turn = self.time.ended_share() or 0.0
        ending = expected_end if self.time.lifetimes_known() else None
        out = []
        for rank in self.fleet.healthy():
            state = states[rank.name]
            if cap is not None and state.sessions + state.reserved_sessions >= cap:
                continue
            held = head_tokens if head_key is not None and head_key in state.heads else 0
            hit = min(max(hits.get(rank.name, 0) * block, held), max(tokens - 1, 0) // block * block)
            queued = self.placement.queued(rank.name) if self.placement is not None else 0
            speed, load = self.speeds.seconds_per_token(rank.name), self.speeds.load(rank.name)
            candidate = Candidate(state, hit, queued, speed, load.waiting)
            need_here = max(need - hit, 0)
            out.append(option(candidate, tokens, need_here, now, chance, ends_at, rounds, last_turn, ending))
        return out
