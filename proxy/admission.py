"""Stage 5, admit: keep each rank's active sessions within its KV pool budget.

A rank's budget is ``pool_tokens x target_fraction``: past about 0.8 of the pool, long sessions
evict each other's cached blocks and the hit rate collapses. A session's working set is its current
context (the prompt of its latest turn plus the answer); sessions seen within ``idle_ttl`` count
against their rank's budget.

- A session already active is always admitted, whatever it has grown to (it is never refused for
  growth); the router keeps it where its blocks are.
- A new session (or one back after idling out) may only go to a rank with room: the budget minus
  the working set fits its prompt (an empty rank always has room), the rank holds fewer than
  ``max_sessions_per_rank`` sessions and its working set does not exceed its pool. The router picks
  among those (``ctx.allowed_backends``). With no room anywhere it waits, first come first served,
  up to ``wait`` seconds, then gets 429 with ``Retry-After``.
- A client key's ``max_sessions`` caps its active sessions (429 at once: waiting would not help).

Between admission and the router's pick a new session is a *reservation* counted against every rank
it was allowed on, so a burst of new sessions cannot all take the same last room.

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
from proxy.sessions import Session, SessionTable
from routing.backends import Backend, BackendPool

log = logging.getLogger("prefixgate.admission")

DEFAULT_TARGET_FRACTION = 0.8
#: Claude Code traces (../shared/traces/claude-code): the gap between a session's requests has a
#: median of 13 s and a p90 of 185 s; 93 % of gaps are under 300 s. A session quiet for longer has
#: most likely ended (or its user has left), and its blocks are fair game.
DEFAULT_IDLE_TTL_S = 300.0
DEFAULT_WAIT_S = 30.0
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
    sessions: int = 0
    reserved_tokens: int = 0
    reserved_sessions: int = 0
    #: When its oldest active session idles out (wall-clock seconds), for Retry-After.
    next_idle_at: float | None = None

    @property
    def over_pool(self) -> bool:
        return self.pool_tokens is not None and self.working_set_tokens > self.pool_tokens

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "pool_tokens": self.pool_tokens,
            "budget_tokens": self.budget_tokens,
            "working_set_tokens": self.working_set_tokens,
            "sessions": self.sessions,
            "reserved_tokens": self.reserved_tokens,
            "over_pool": self.over_pool,
        }


@dataclass(slots=True)
class _Reservation:
    allowed: frozenset[str]
    tokens: int
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
        pool: BackendPool,
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
        if session is not None and session.is_active(now, self.config.idle_ttl):
            session.last_seen = now
            session.turns += 1
            session.context_tokens = tokens
            session.context_blocks = self._blocks(ctx, session.context_tokens)
            if session.client is None:
                session.client = ctx.client_label
            ctx.session = session
            self.table.save(session)
            return
        if session is None:
            session = Session(key=key, created=now, last_seen=now, client=ctx.client_label)
        if self.config.enabled:
            self._check_client_cap(ctx.client_label, ctx.client_max_sessions, now)
            ctx.allowed_backends = await self._wait_for_room(key, tokens, receive)
        session.last_seen = self.table.clock()
        session.turns += 1
        session.context_tokens = tokens
        session.context_blocks = self._blocks(ctx, tokens)
        session.rank = None  # back after idling out: wherever the router now sends it
        ctx.session = session
        self.table.save(session)

    def _prompt_tokens(self, ctx: RequestContext) -> int:
        if ctx.prompt_tokens is not None:
            return ctx.prompt_tokens
        return len(ctx.raw_body) // BYTES_PER_TOKEN

    def _blocks(self, ctx: RequestContext, tokens: int) -> int:
        if ctx.block_hashes and tokens == ctx.prompt_tokens:
            return len(ctx.block_hashes)
        return -(-tokens // self.config.block_size)

    def _check_client_cap(self, client: str | None, cap: int | None, now: float) -> None:
        if client is None or cap is None:
            return
        active = sum(1 for s in self.table.active(now) if s.client == client)
        if active >= cap:
            self._rejected("client_sessions")
            idle_at = min((s.last_seen for s in self.table.active(now) if s.client == client), default=now)
            raise too_many_requests(
                f"client {client!r} already has {active} active sessions (its limit is {cap}); "
                "end one (DELETE /admin/sessions/{id}) or let one idle out",
                "too_many_sessions",
                idle_at + self.config.idle_ttl - now,
            )

    async def _wait_for_room(self, key: str, tokens: int, receive: Receive | None) -> frozenset[str] | None:
        """The ranks with room for a new session of ``tokens``, waiting FIFO up to ``wait`` seconds.

        None: admission cannot restrict anything (no rank has a known pool or session cap).
        """
        if not self.pool.healthy():
            return None  # the router answers 503: waiting for room would not bring a rank back
        allowed, _ = self.rooms(tokens)
        if allowed and not self._queue:
            return self._reserve(key, allowed, tokens)
        if receive is None:
            return await self._queued(key, tokens)
        return await until_disconnected(receive, self._queued(key, tokens))

    def _reserve(self, key: str, allowed: frozenset[str], tokens: int) -> frozenset[str]:
        # in the same step as the room check: the next waiter must see this session's claim
        self._reservations[key] = _Reservation(allowed, tokens)
        return allowed

    async def _queued(self, key: str, tokens: int) -> frozenset[str]:
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
                    allowed, states = self.rooms(tokens)
                    if allowed:
                        return self._reserve(key, allowed, tokens)
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
            f"{s.name} {s.working_set_tokens}/{s.budget_tokens} tokens, {s.sessions} sessions"
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
        idle_ttl = self.config.idle_ttl
        for session in self.table.active(now):
            state = states.get(session.rank) if session.rank is not None else None
            if state is None:
                continue
            state.working_set_tokens += session.context_tokens
            state.sessions += 1
            idle_at = session.last_seen + idle_ttl
            if state.next_idle_at is None or idle_at < state.next_idle_at:
                state.next_idle_at = idle_at
        self._expire_reservations()
        for reservation in self._reservations.values():
            for name in reservation.allowed:
                state = states.get(name)
                if state is not None:
                    state.reserved_tokens += reservation.tokens
                    state.reserved_sessions += 1
        self._report(states)
        return states

    def rooms(self, tokens: int) -> tuple[frozenset[str], dict[str, RankState]]:
        """The healthy ranks with room for a new session of ``tokens``, and every rank's state."""
        states = self.rank_states()
        cap = self.config.max_sessions_per_rank
        allowed = []
        for backend in self.pool.healthy():
            state = states[backend.name]
            if state.over_pool:
                continue
            if cap is not None and state.sessions + state.reserved_sessions >= cap:
                continue
            if state.budget_tokens is not None:
                used = state.working_set_tokens + state.reserved_tokens
                empty = state.sessions + state.reserved_sessions == 0
                if used + tokens > state.budget_tokens and not empty:
                    continue
            allowed.append(backend.name)
        return frozenset(allowed), states

    def _expire_reservations(self) -> None:
        if not self._reservations:
            return
        deadline = time.monotonic() - RESERVATION_TTL_S
        for key in [k for k, r in self._reservations.items() if r.since < deadline]:
            del self._reservations[key]

    # -- after routing and after the answer ---------------------------------------------------------

    def routed(self, ctx: RequestContext, backend: Backend) -> None:
        """The router picked ``backend`` for ``ctx`` (the ``Router.on_pick`` hook)."""
        session = ctx.session
        if not isinstance(session, Session):
            return
        if ctx.session_key is not None:
            self._reservations.pop(ctx.session_key, None)
        if session.rank != backend.name:
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
            session.context_tokens = usage.prompt_tokens + usage.completion_tokens
            session.context_blocks = -(-session.context_tokens // self.config.block_size)
        self.table.save(session)
        self._notify()

    def release(self, key: str) -> Session | None:
        """End a session at once (``DELETE /admin/sessions/{id}``): its budget is free for the queue."""
        self._reservations.pop(key, None)
        session = self.table.delete(key)
        self._notify()
        return session

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
    settings: Settings, table: SessionTable, pool: BackendPool, metrics: object, block_size: int
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
