"""Stage 5, admit: keep each rank's active sessions within its KV pool budget.

A rank's budget is ``pool_tokens x target_fraction``: past about 0.8 of the pool, long sessions
evict each other's cached blocks and the hit rate collapses. A session's working set is its current
context (the prompt of its latest turn plus the answer); sessions seen within ``idle_ttl`` count
against their rank's budget.

- A session already active is always admitted, whatever it has grown to (it is never refused for
  growth), and homed on its rank (``ctx.home_backend``): the router keeps it there unless that rank
  is down or truly saturated, never merely for load (a move recomputes its whole context and
  lands on a rank whose budget never counted it).
- Sessions grow (a coding agent's context gains every tool result), so room is counted in
  *projected* tokens: each active session, and the new one, as large as recently ended sessions of
  at least its size grew (``proxy/session_growth.py``; its current size until some has ended). A
  rank filled to its budget with sessions' current sizes would later hold their grown contexts far
  past its pool, and its sessions would evict each other's blocks. Only sessions that ended by
  themselves (idled out, or deleted) say how far sessions grow: a released one was cut short.
- When a rank's sessions have outgrown its pool anyway (their growth outran the projection), one
  of them moves, once, at its own turn, to a rank with room: the smallest whose context covers the
  excess (``_rehome``). Otherwise they would evict each other's blocks turn after turn.
- A new session (or one back after idling out) may only go to a rank with room: the budget minus
  the projected working set fits its projected size (an empty rank always has room), the rank
  holds fewer than ``max_sessions_per_rank`` sessions and its working set does not exceed its
  pool. The router picks among those (``ctx.allowed_backends``). With no room anywhere it waits,
  first come first served, up to ``wait`` seconds, then gets 429 with ``Retry-After``.
- A client key's ``max_sessions`` caps its active sessions (429 at once: waiting would not help).

Between admission and the router's pick a new session is a *reservation* counted against every rank
it was allowed on, so a burst of new sessions cannot all take the same last room.

Two refinements keep the budget close to what the rank's prefix cache really holds:

- Sessions of one agent share their leading system+tools segment (about 15k tokens for Claude
  Code), and a rank caches those blocks once: a rank's working set counts each distinct head once,
  and a new session whose head a rank already holds needs room for the rest of its prompt only.
- A session rarely announces its end, and the idle TTL is sized for the slowest thinkers. A session
  whose latest request was answered and which has then been quiet for longer than
  ``release_factor`` x its own longest think gap so far (bounded to ``[release_min, idle_ttl]``;
  ``idle_ttl`` until it has shown a gap) is *reclaimable*: it keeps counting while nobody needs the
  room (so it is never thrashed for nothing), but when a new session finds no room, the rank's
  reclaimable sessions are released longest-idle first until it fits. A released session that comes
  back is a new session (it waits for room like any other); its blocks are the rank's LRU victims
  first anyway. Sessions with a request in flight are never reclaimable.

The FIFO queue is per replica; with Redis the replicas share the table (and so each other's
working sets), not the queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field

from starlette.types import Receive

from proxy.config import Settings
from proxy.context import RequestContext
from proxy.errors import ProxyError
from proxy.forward import until_disconnected
from proxy.observe import Usage
from proxy.session_growth import PeakEstimator
from proxy.sessions import Session, SessionTable
from proxy.think_gaps import OWN_EVIDENCE, ThinkGaps
from routing.ranks import Fleet, Rank

log = logging.getLogger("prefixgate.admission")

#: Labels of a prompt's first part when it is the system+tools segment sessions of one agent share.
_HEAD_PARTS = frozenset({"system+tools", "system", "tools"})

DEFAULT_TARGET_FRACTION = 0.8
#: Claude Code traces (../shared/traces/claude-code): the gap between a session's requests has a
#: median of 13 s and a p90 of 185 s; 93 % of gaps are under 300 s. A session quiet for longer has
#: most likely ended (or its user has left), and its blocks are fair game.
DEFAULT_IDLE_TTL_S = 300.0
DEFAULT_WAIT_S = 30.0
#: A session quiet for longer than this many times its longest think gap so far has most likely ended:
#: in those traces a session's next gap exceeds twice its longest earlier gap for ~5 % of gaps.
DEFAULT_RELEASE_FACTOR = 2.0
#: ... but never sooner than this fraction of the idle TTL (30 s for the default 300 s).
DEFAULT_RELEASE_MIN_FRACTION = 0.1
#: The population's think gap that stands in for a session's own: the 95th percentile.
TYPICAL_GAP_QUANTILE = 0.95
#: A reservation not routed within this many seconds (its request failed early) is dropped.
RESERVATION_TTL_S = 30.0
#: Without a token count (policies that skip the blocks stage) a prompt is estimated from its body.
BYTES_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    enabled: bool = True
    target_fraction: float = DEFAULT_TARGET_FRACTION
    idle_ttl: float = DEFAULT_IDLE_TTL_S
    wait: float = DEFAULT_WAIT_S
    max_sessions_per_rank: int | None = None
    block_size: int = 16
    release_factor: float = DEFAULT_RELEASE_FACTOR
    #: Fraction of ``idle_ttl``: the least idle time after which a session can be reclaimed.
    release_min_fraction: float = DEFAULT_RELEASE_MIN_FRACTION

    def release_after(self, session: Session, typical_gap: float | None = None) -> float:
        """Seconds after its last answer from which ``session`` counts as ended when room is needed.

        ``typical_gap``: a long think gap of the population (``ThinkGaps``), which stands in for the
        session's own while it has fewer than ``OWN_EVIDENCE`` gaps: with none it would hold its room
        for the whole idle TTL, with one short gap it would count as ended after twice that.
        """
        if typical_gap is not None and session.gaps < OWN_EVIDENCE:
            estimate = max(session.gap_max, typical_gap)
        elif session.gaps:
            estimate = session.gap_max
        else:
            return self.idle_ttl  # no think time seen yet: nothing to judge by
        floor = self.idle_ttl * self.release_min_fraction
        return min(self.idle_ttl, max(floor, self.release_factor * estimate))

    @property
    def poll_interval(self) -> float:
        """How often a queued request re-checks: sessions idle out with time, other replicas change."""
        return min(0.25, max(self.idle_ttl / 10, 0.01))


@dataclass(slots=True)
class RankState:
    """One rank's share of the active sessions, as admission counts it."""

    name: str
    pool_tokens: int | None
    budget_tokens: int | None
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
    #: Its sessions' keys and context tokens.
    members: list[tuple[str, int]] = field(default_factory=list)

    @property
    def over_pool(self) -> bool:
        return self.pool_tokens is not None and self.working_set_tokens > self.pool_tokens


@dataclass(slots=True)
class _Reservation:
    allowed: frozenset[str]
    tokens: int
    #: Per allowed rank, the reclaimable sessions it only has room with once they are released.
    victims: dict[str, tuple[str, ...]] = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)


def too_many_requests(message: str, code: str, retry_after: float) -> ProxyError:
    return ProxyError(
        429,
        message,
        type_="rate_limit_error",
        code=code,
        headers={"retry-after": str(max(1, math.ceil(retry_after)))},
    )


class Admission:
    """Session accounting and admission control (stage 5), and the session updates after routing."""

    def __init__(
        self,
        table: SessionTable,
        pool: Fleet,
        config: AdmissionConfig,
        metrics: object | None = None,
    ) -> None:
        self.table = table
        self.pool = pool
        self.config = config
        self.metrics = metrics
        self._queue: deque[object] = deque()
        self._changed = asyncio.Event()
        self._reservations: dict[str, _Reservation] = {}
        self._over_pool: set[str] = set()
        #: Peaks of the sessions that ended (idled out or deleted): how far sessions grow.
        self.peaks = PeakEstimator()
        #: Every session's think gaps: the stand-in for a session that has shown few of its own.
        self.think_gaps = ThinkGaps()
        #: Active sessions at the last count and their context: one missing next time has ended.
        self._live: dict[str, int] = {}
        #: Each rank's working set at the last count: a session's turn checks its rank against it.
        self._last_working_set: dict[str, int] = {}

    # -- stage 5 ----------------------------------------------------------------------------------

    async def admit(self, ctx: RequestContext, receive: Receive | None = None) -> None:
        """Return when ``ctx`` may proceed (``ctx.allowed_backends`` set for a new session).

        Raises ``ProxyError(429)`` when the client is at its session cap, or when no rank had room
        within the admission wait; ``ClientDisconnected`` when the client (``receive``) leaves while
        queued.
        """
        key = ctx.session_key
        if key is None:
            return
        now = self.table.clock()
        tokens = self._prompt_tokens(ctx)
        session = self.table.get(key)
        head_key, head_tokens = self._head(ctx)
        if session is not None and session.is_active(now, self.config.idle_ttl):
            self._note_gap(session.note_request(now))
            old_tokens = session.context_tokens
            if session.client is None:
                session.client = ctx.client_label
            self._take_turn(ctx, session, tokens, head_key, head_tokens)
            if self.config.enabled:
                ctx.allowed_backends = self._rehome(session, old_tokens, head_key, head_tokens)
                if ctx.allowed_backends is None:
                    ctx.home_backend = session.rank  # admitted there: the router keeps it there
            return
        if session is None:
            session = Session(key=key, created=now, last_seen=now, client=ctx.client_label)
        else:
            self._note_gap(session.note_request(now))  # back after ending: one of its think times too
        if self.config.enabled:
            self._check_client_cap(ctx.client_label, ctx.client_max_sessions, now)
            ctx.allowed_backends = await self._wait_for_room(key, tokens, receive, head_key, head_tokens)
        session.released = False
        session.last_seen = self.table.clock()
        session.rank = None  # back after idling out: wherever the router now sends it
        self._take_turn(ctx, session, tokens, head_key, head_tokens)

    def _take_turn(
        self, ctx: RequestContext, session: Session, tokens: int, head_key: str | None, head_tokens: int
    ) -> None:
        """``ctx`` is ``session``'s next turn: its context is now this prompt of ``tokens``."""
        session.head_key, session.head_tokens = head_key, head_tokens
        session.turns += 1
        session.context_tokens = tokens
        session.context_blocks = self._blocks(ctx, tokens)
        ctx.session = session
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
        and ``session`` is the one to go; None: it stays.

        Grown past its pool, a rank evicts its sessions' blocks turn after turn (each returning
        session recomputes its tail and evicts the next one's). Moving one session recomputes it
        once. The one to move is the smallest whose context covers the excess (the cheapest to
        recompute that ends it; the largest when none does), at its own turn, and only to a rank
        with room for its projected size as it stands (nobody is released for it).
        """
        rank = session.rank
        backend = self.pool.get(rank) if rank is not None else None
        if backend is None or not backend.pool_tokens:
            return None
        last = self._track(backend.name, session.context_tokens - old_tokens)
        if last is not None and last <= backend.pool_tokens:
            return None  # the cheap check (an over-estimate: shared heads count in full)
        states = self.rank_states()
        state = states[backend.name]
        excess = state.working_set_tokens - backend.pool_tokens
        if excess <= 0 or len(state.members) < 2:
            return None
        covering = [m for m in state.members if m[1] >= excess]
        chosen = min(covering, key=lambda m: m[1]) if covering else max(state.members, key=lambda m: m[1])
        if chosen[0] != session.key:
            return None
        # room as is (nobody released for a move), counted on the states just taken
        allowed, _, _ = self._find_room(session.context_tokens, head_key, head_tokens, states, release=False)
        allowed = allowed - {backend.name}
        if not allowed:
            return None
        log.info(
            "session %s re-homed before its turn %d: %s holds %d tokens past its pool of %d; room on %s",
            session.key,
            session.turns - 1,
            backend.name,
            excess,
            backend.pool_tokens,
            ", ".join(sorted(allowed)),
        )
        return self._reserve(session.key, allowed, self.projected(session.context_tokens), {})

    def _track(self, rank: str, delta: int) -> int | None:
        """Keep the last count of ``rank``'s working set current between full counts (``rank_states``)
        as its sessions grow, arrive and leave; its new value (None before the first count)."""
        last = self._last_working_set.get(rank)
        if last is None:
            return None
        last = self._last_working_set[rank] = last + delta
        return last

    def _prompt_tokens(self, ctx: RequestContext) -> int:
        if ctx.prompt_tokens is not None:
            return ctx.prompt_tokens
        return len(ctx.raw_body) // BYTES_PER_TOKEN

    def _head(self, ctx: RequestContext) -> tuple[str | None, int]:
        """The prompt's leading system+tools segment in full blocks: (key, tokens), or (None, 0)."""
        blocks = ctx.prompt_blocks
        if blocks is None or not blocks.parts or blocks.parts[0][0] not in _HEAD_PARTS:
            return None, 0
        count = min(blocks.parts[0][2] // blocks.block_size, len(blocks.block_hashes))
        if count == 0:
            return None, 0
        last = blocks.block_hashes[count - 1]
        # chained hashes: the last block's hash names the whole head (and its salt)
        return (last.hex() if isinstance(last, bytes) else str(last)), count * blocks.block_size

    def _blocks(self, ctx: RequestContext, tokens: int) -> int:
        if ctx.block_hashes and tokens == ctx.prompt_tokens:
            return len(ctx.block_hashes)
        return -(-tokens // self.config.block_size)

    def _check_client_cap(self, client: str | None, cap: int | None, now: float) -> None:
        if client is None or cap is None:
            return
        mine = [s.last_seen for s in self.table.active(now) if s.client == client]
        if len(mine) >= cap:
            self._rejected("client_sessions")
            idle_at = min(mine, default=now)
            raise too_many_requests(
                f"client {client!r} already has {len(mine)} active sessions (its limit is {cap}); "
                "end one (DELETE /admin/sessions/{id}) or let one idle out",
                "too_many_sessions",
                idle_at + self.config.idle_ttl - now,
            )

    async def _wait_for_room(
        self,
        key: str,
        tokens: int,
        receive: Receive | None,
        head_key: str | None = None,
        head_tokens: int = 0,
    ) -> frozenset[str] | None:
        """The ranks with room for a new session of ``tokens``, waiting FIFO up to ``wait`` seconds.

        None: admission cannot restrict anything (no rank has a known pool or session cap).
        """
        if not self.pool.healthy():
            return None  # the router answers 503: waiting for room would not bring a rank back
        if not self._queue:
            allowed, victims, _ = self._find_room(tokens, head_key, head_tokens)
            if allowed:
                return self._reserve(key, allowed, self.projected(tokens), victims)
        queued = self._queued(key, tokens, head_key, head_tokens)
        if receive is None:
            return await queued
        return await until_disconnected(receive, queued)

    def _reserve(
        self, key: str, allowed: frozenset[str], tokens: int, victims: dict[str, tuple[str, ...]]
    ) -> frozenset[str]:
        # in the same step as the room check: the next waiter must see this session's claim
        self._reservations[key] = _Reservation(allowed, tokens, victims)
        return allowed

    async def _queued(self, key: str, tokens: int, head_key: str | None, head_tokens: int) -> frozenset[str]:
        states: dict[str, RankState] = {}
        waiter = object()
        if self.metrics is not None:
            self.metrics.admission_queued.inc()  # type: ignore[attr-defined]
        self._queue.append(waiter)
        self._set_queue_depth()
        deadline = time.monotonic() + self.config.wait
        try:
            while True:
                if self._queue[0] is waiter:
                    allowed, victims, states = self._find_room(tokens, head_key, head_tokens)
                    if allowed:
                        return self._reserve(key, allowed, self.projected(tokens), victims)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._no_room(tokens, states or self.rank_states())
                changed = self._changed
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(changed.wait(), min(left, self.config.poll_interval))
        finally:
            self._queue.remove(waiter)
            self._set_queue_depth()
            self._notify()

    def _no_room(self, tokens: int, states: dict[str, RankState]) -> ProxyError:
        now = self.table.clock()
        waits = [s.next_idle_at - now for s in states.values() if s.next_idle_at is not None]
        retry_after = min(waits) if waits else self.config.idle_ttl
        budget_full = any(s.budget_tokens is not None for s in states.values())
        reason = "pool_full" if budget_full else "rank_sessions"
        self._rejected(reason)
        summary = ", ".join(
            f"{s.name} {s.projected_tokens}/{s.budget_tokens} tokens as its sessions grow "
            f"({s.working_set_tokens} now), {s.sessions} sessions"
            for s in states.values()
        )
        log.info("429: no rank has room for a new session of %d tokens (%s)", tokens, summary)
        return too_many_requests(
            f"no rank has room for a new session of {tokens} prompt tokens after waiting "
            f"{self.config.wait:g} s: every rank's active sessions fill its KV cache budget "
            f"({self.config.target_fraction:g} of its pool) or its session limit ({summary})",
            "admission_" + reason,
            retry_after,
        )

    # -- accounting ---------------------------------------------------------------------------------

    def rank_states(self, now: float | None = None) -> dict[str, RankState]:
        """Working set and session count per rank from the active sessions and reservations."""
        now = self.table.clock() if now is None else now
        fraction = self.config.target_fraction
        states = {
            b.name: RankState(b.name, b.pool_tokens, int(b.pool_tokens * fraction) if b.pool_tokens else None)
            for b in self.pool
        }
        config = self.config
        idle_ttl = config.idle_ttl
        self._expire_reservations()
        # sessions a pending reservation will release: their room is spoken for already
        claimed = {
            (name, victim)
            for reservation in self._reservations.values()
            for name, victims in reservation.victims.items()
            for victim in victims
        }
        reclaimable: list[tuple[float, Session, RankState]] = []
        active = self.table.active(now)
        live = {session.key: session.context_tokens for session in active}
        self._note_ended(live)
        expected_peak = self.peaks.expected_peak
        typical = self.typical_gap()
        for session in active:
            state = states.get(session.rank) if session.rank is not None else None
            if state is None or (state.name, session.key) in claimed:
                continue
            tokens = session.context_tokens
            projected = expected_peak(tokens)
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
            if session.answered and now - session.answered_at > config.release_after(session, typical):
                reclaimable.append((session.answered_at, session, state))
        reclaimable.sort(key=lambda item: item[0])  # longest idle first
        for _, session, state in reclaimable:
            # a head other sessions also hold stays cached: releasing frees the rest only
            shared = session.head_key is not None and state.heads[session.head_key] > 1
            freed = expected_peak(session.context_tokens) - (session.head_tokens if shared else 0)
            state.reclaimable.append((session, max(freed, 0)))
        for reservation in self._reservations.values():
            for name in reservation.allowed:
                state = states.get(name)
                if state is not None:
                    state.reserved_tokens += reservation.tokens
                    state.reserved_sessions += 1
        self._last_working_set = {name: state.working_set_tokens for name, state in states.items()}
        self._report(states)
        return states

    def projected(self, tokens: int) -> int:
        """The room a session of ``tokens`` needs: as large as sessions of its size grew before ending."""
        return self.peaks.expected_peak(tokens)

    def _note_ended(self, live: dict[str, int]) -> None:
        """Sessions active at the last count and not now have ended: their last context is their peak
        (unless admission released them: cut short, they may come back and grow on)."""
        for key, tokens in self._live.items():
            if key not in live:
                ended = self.table.get(key)
                if ended is None or not ended.released:
                    self.peaks.add(tokens)
        self._live = live

    def _find_room(
        self,
        tokens: int,
        head_key: str | None,
        head_tokens: int,
        states: dict[str, RankState] | None = None,
        *,
        release: bool = True,
    ) -> tuple[frozenset[str], dict[str, tuple[str, ...]], dict[str, RankState]]:
        """The healthy ranks with room for a new session of ``tokens``, per rank the sessions to release
        for it (on ranks that have room only once those go), and every rank's state (``states``: a
        count just taken, else counted now). ``release=False``: ranks with room as they are only.

        Room is counted in projected tokens: each active session (and the new one) as large as
        sessions of its size grew before ending (``PeakEstimator``), so a rank is not filled with
        sessions that will outgrow its pool. With ``head_key``, a rank already holding that
        shared head needs room for the rest only. Ranks that have room only once reclaimable
        sessions (judged ended: idle past their think times) are released count as having room too,
        even when another rank has room as is: the router then weighs them by what they hold (a rank
        holding the new session's prefix is worth releasing an ended session's budget for), and the
        sessions are released only if it picks that rank.
        """
        if states is None:
            states = self.rank_states()
        projected = self.projected(tokens)
        cap = self.config.max_sessions_per_rank
        allowed = []
        short: dict[str, int] = {}  # rank -> tokens missing, for ranks only the budget keeps out
        for backend in self.pool.healthy():
            state = states[backend.name]
            held = head_key is not None and head_key in state.heads
            need = projected - head_tokens if held else projected
            if state.over_pool:
                continue
            if cap is not None and state.sessions + state.reserved_sessions >= cap:
                continue
            if state.budget_tokens is not None:
                used = state.projected_tokens + state.reserved_tokens
                empty = state.sessions + state.reserved_sessions == 0
                if used + need > state.budget_tokens and not empty:
                    short[backend.name] = used + need - state.budget_tokens
                    continue
            allowed.append(backend.name)
        if not short or not release:
            return frozenset(allowed), {}, states
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
        return frozenset(allowed).union(victims), victims, states

    def _expire_reservations(self) -> None:
        if not self._reservations:
            return
        deadline = time.monotonic() - RESERVATION_TTL_S
        for key in [k for k, r in self._reservations.items() if r.since < deadline]:
            del self._reservations[key]

    # -- after routing and after the answer ---------------------------------------------------------

    def routed(self, ctx: RequestContext, backend: Rank) -> None:
        """The router picked ``backend`` for ``ctx`` (the ``Router.on_pick`` hook)."""
        session = ctx.session
        if not isinstance(session, Session):
            return
        if ctx.session_key is not None:
            reservation = self._reservations.pop(ctx.session_key, None)
            if reservation is not None and reservation.victims.get(backend.name):
                self._release_idle(backend.name, reservation.victims[backend.name], ctx.session_key)
        if session.rank != backend.name:
            if session.rank is not None:
                self._track(session.rank, -session.context_tokens)
            self._track(backend.name, session.context_tokens)
            session.rank = backend.name
            self.table.save(session)

    def observed(self, ctx: RequestContext, backend: str, usage: Usage | None) -> None:
        """The rank answered: the session's counters, its context after the answer, the fleet window."""
        if usage is not None and usage.cached_tokens is not None:
            self.table.fleet.add(usage.prompt_tokens, usage.cached_tokens)
        session = ctx.session
        if not isinstance(session, Session):
            return
        session.rank = backend
        session.last_seen = max(session.last_seen, self.table.clock())
        if ctx.estimated_cached_tokens is not None:
            session.hit_tokens_estimated += ctx.estimated_cached_tokens
        if usage is not None:
            cached = usage.cached_tokens or 0
            session.prompt_tokens_sent += usage.prompt_tokens
            session.hit_tokens_reported += cached
            session.prefill_tokens += usage.prompt_tokens - cached
            # the next turn re-sends this prompt and the answer: that is what the rank now holds
            context = usage.prompt_tokens + usage.completion_tokens
            if session.rank is not None:
                self._track(session.rank, context - session.context_tokens)
            session.context_tokens = context
            session.context_blocks = -(-session.context_tokens // self.config.block_size)
        session.answered_at = session.last_seen
        self.table.save(session)
        self._notify()

    def release(self, key: str) -> Session | None:
        """End a session at once (``DELETE /admin/sessions/{id}``): its budget is free for the queue."""
        self._reservations.pop(key, None)
        session = self.table.delete(key)
        self._notify()
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

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    # -- metrics and logs ---------------------------------------------------------------------------

    def _rejected(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.admission_rejected.labels(reason).inc()  # type: ignore[attr-defined]

    def _set_queue_depth(self) -> None:
        if self.metrics is not None:
            self.metrics.admission_queue_depth.set(len(self._queue))  # type: ignore[attr-defined]

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def _report(self, states: dict[str, RankState]) -> None:
        metrics = self.metrics
        for state in states.values():
            over = state.over_pool
            if over and state.name not in self._over_pool:
                self._over_pool.add(state.name)
                log.warning(
                    "rank %s: active working set %d tokens exceeds its pool of %s tokens "
                    "(%d sessions): no new sessions go there until it shrinks",
                    state.name,
                    state.working_set_tokens,
                    state.pool_tokens,
                    state.sessions,
                )
            elif not over and state.name in self._over_pool:
                self._over_pool.discard(state.name)
                log.info("rank %s: working set back within its pool", state.name)
            if metrics is not None:
                m: object = metrics
                m.sessions_active.labels(state.name).set(state.sessions)  # type: ignore[attr-defined]
                m.rank_working_set.labels(state.name).set(state.working_set_tokens)  # type: ignore[attr-defined]
                m.rank_over_pool.labels(state.name).set(1 if over else 0)  # type: ignore[attr-defined]
                if state.pool_tokens is not None:
                    m.rank_pool_tokens.labels(state.name).set(state.pool_tokens)  # type: ignore[attr-defined]

    def refresh_metrics(self, max_sessions: int = 1000) -> None:
        """At scrape time: rank gauges, the fleet hit rate and the active sessions' hit rates."""
        self.rank_states()
        metrics = self.metrics
        if metrics is None:
            return
        metrics.fleet_hit_rate.set(self.table.fleet.rate)  # type: ignore[attr-defined]
        gauge = metrics.session_hit_rate  # type: ignore[attr-defined]
        # only active sessions are exported, so the series come and go with the sessions
        gauge.clear()
        active = sorted(self.table.active(), key=lambda s: s.last_seen, reverse=True)[:max_sessions]
        for session in active:
            rate = session.hit_rate
            if rate is not None:
                gauge.labels(session.key, session.rank or "").set(rate)


def admission_from_settings(
    settings: Settings, table: SessionTable, pool: Fleet, metrics: object, block_size: int
) -> Admission:
    """``Admission`` for ``no_admission``, ``target_fraction``, ``session_idle_ttl``, ... ."""
    config = AdmissionConfig(
        enabled=not settings.no_admission,
        target_fraction=settings.target_fraction,
        idle_ttl=settings.session_idle_ttl,
        wait=settings.admission_wait,
        max_sessions_per_rank=settings.max_sessions_per_rank or None,
        block_size=block_size,
    )
    return Admission(table, pool, config, metrics)
