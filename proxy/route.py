"""Stage 6, pick a rank: the policy chooses among healthy ranks, over the prefix index's view.

The router owns the policy and the prefix index. For each request it looks up (one index access)
how many leading blocks of the prompt each rank probably holds and which rank the session used,
lets the policy choose, records the prompt's blocks on the chosen rank at once (so a burst of
sibling requests lands together) and remembers the session's rank. After the answer, ``observe``
compares the predicted hit with what the rank reported and corrects the rank's mirror.

Ranks whose mirror is fed by KV-cache events (``exact``) get no speculative records or corrections:
their events are the truth.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from proxy.context import RequestContext
from proxy.errors import no_healthy_backend
from routing.index import Lookup, PrefixIndex
from routing.index.memory import MemoryPrefixIndex
from routing.policies import RouteRequest, RoutingPolicy
from routing.policies.bounds import max_hit_blocks, prompt_size
from routing.ranks import Fleet, Rank

log = logging.getLogger("prefixgate.route")

#: Block size assumed when neither the rank nor the configuration says (vLLM's CUDA default).
DEFAULT_BLOCK_SIZE = 16
#: Bound of a rank's speculative mirror when its pool size is unknown (no ``vllm:cache_config_info``,
#: no ``pool_tokens``): without one, routing's own records grow the index forever (~200 B per block).
#: 131,072 blocks = 2M tokens at block size 16 (~26 MB of mirror), the size of a large GPU pool.
UNKNOWN_POOL_BLOCKS = 131_072
#: A routed request not observed within this many seconds (it failed, or the client left) no longer
#: counts as queued prefill on its rank.
DEFAULT_PENDING_TTL_S = 120.0


@dataclass(slots=True)
class _Pending:
    backend: str
    prefill: int
    tokens: int
    since: float


class Router:
    """Chooses a rank per request and keeps the prefix index in step with what was routed."""

    def __init__(
        self,
        pool: Fleet,
        policy: RoutingPolicy,
        index: PrefixIndex | None = None,
        *,
        block_size: int | None = None,
        metrics: object | None = None,
        exact: Iterable[str] = (),
        pending_ttl: float = DEFAULT_PENDING_TTL_S,
    ) -> None:
        self.pool = pool
        self.policy = policy
        self.index: PrefixIndex = index if index is not None else MemoryPrefixIndex()
        self.block_size = block_size or next((b.block_size for b in pool if b.block_size), DEFAULT_BLOCK_SIZE)
        self.metrics = metrics
        self.exact = set(exact)
        self.pending_ttl = pending_ttl
        self._pending: OrderedDict[int, _Pending] = OrderedDict()
        self.queued_prefill: dict[str, int] = {b.name: 0 for b in pool}
        #: Prompt tokens routed to each rank and not answered yet (KV its running requests hold).
        self.inflight_tokens: dict[str, int] = {b.name: 0 for b in pool}
        #: Called with (ctx, backend) after each pick (admission records the session's rank).
        self.on_pick: Callable[[RequestContext, Rank], None] | None = None
        for b in pool:
            self.index.set_capacity(b.name, self.capacity_blocks(b))

    def capacity_blocks(self, backend: Rank) -> int | None:
        """The rank's pool in blocks; ``UNKNOWN_POOL_BLOCKS`` for an unknown pool; None (unbounded)
        for a mirror driven by KV-cache events, which remove what the rank evicts."""
        if backend.name in self.exact:
            return None
        if not backend.pool_tokens:
            return UNKNOWN_POOL_BLOCKS
        return backend.pool_tokens // self.block_size

    def set_exact(self, backend: str, exact: bool = True) -> None:
        """Mark ``backend``'s mirror as driven by KV-cache events (or not)."""
        if exact:
            self.exact.add(backend)
        else:
            self.exact.discard(backend)
        b = self.pool.get(backend)
        if b is not None:
            self.index.set_capacity(backend, self.capacity_blocks(b))

    def pick(self, ctx: RequestContext | None, tried: Collection[str] = ()) -> Rank:
        candidates = self.pool.healthy(exclude=tried)
        allowed = ctx.allowed_backends if ctx is not None else None
        if allowed is not None:  # admission: a new session only goes to a rank with room
            candidates = [b for b in candidates if b.name in allowed]
        if not candidates:
            raise no_healthy_backend()
        if ctx is None:
            return self.policy.order(RouteRequest(block_size=self.block_size), candidates)[0]
        self._release(id(ctx))  # a retry: the previous attempt's rank did not answer
        self._expire()
        hashes = ctx.block_hashes
        key = ctx.session_key
        found = self.index.lookup(hashes, key) if hashes or key else Lookup()
        if len(candidates) == 1:
            backend = candidates[0]
        else:
            request = RouteRequest(
                key,
                ctx.prompt_tokens,
                hashes,
                found.matches,
                found.session_rank,
                self.block_size,
                self.queued_prefill,
                ctx.home_backend,
                self.inflight_tokens,
            )
            backend = self.policy.order(request, candidates)[0]
        name = backend.name
        hit_blocks = min(
            found.matches.get(name, 0), max_hit_blocks(ctx.prompt_tokens, len(hashes), self.block_size)
        )
        estimate = hit_blocks * self.block_size
        ctx.estimated_cached_tokens = estimate if hashes else None
        prompt = prompt_size(ctx.prompt_tokens, len(hashes), self.block_size)
        prefill = max(prompt - estimate, 0)
        self._pending[id(ctx)] = _Pending(name, prefill, prompt, time.monotonic())
        self.queued_prefill[name] = self.queued_prefill.get(name, 0) + prefill
        self.inflight_tokens[name] = self.inflight_tokens.get(name, 0) + prompt
        if key and found.session_rank != name:
            if found.session_rank is not None:
                self._log_move(ctx, found.session_rank, name, candidates, prefill)
            self.index.set_session_rank(key, name)
        if hashes and name not in self.exact:
            self.index.record(name, hashes)
        if self.on_pick is not None:
            self.on_pick(ctx, backend)
        return backend

    def observe(self, ctx: RequestContext, backend: Rank, cached_tokens: int | None) -> None:
        """After the answer: what the rank reported (``cached_tokens``; None when it did not say).

        Releases the request's queued prefill, counts predicted vs reported hit tokens and, when the
        rank hit fewer tokens than predicted, drops the blocks past the actual hit from its mirror.
        """
        self._release(id(ctx))
        predicted = ctx.estimated_cached_tokens
        if predicted is None or cached_tokens is None:
            return
        metrics = self.metrics
        if metrics is not None:
            metrics.predicted_cached_tokens.labels(backend.name).inc(predicted)  # type: ignore[attr-defined]
            metrics.reported_cached_tokens.labels(backend.name).inc(cached_tokens)  # type: ignore[attr-defined]
        if backend.name in self.exact or cached_tokens >= predicted:
            return
        actual_blocks = cached_tokens // self.block_size
        self.index.remove(backend.name, ctx.block_hashes[actual_blocks:])
        if metrics is not None:
            metrics.index_corrections.labels(backend.name).inc()  # type: ignore[attr-defined]

    def _log_move(
        self, ctx: RequestContext, old: str, new: str, candidates: Sequence[Rank], prefill: int
    ) -> None:
        """Say why a known session left its rank: each move recomputes its context elsewhere."""
        if not log.isEnabledFor(logging.INFO):
            return
        if ctx.allowed_backends is not None:
            room = ", ".join(sorted(ctx.allowed_backends))
            reason = f"admitted anew (back after idling out or being released), room on {room}"
        elif all(b.name != old for b in candidates):
            reason = "its rank is down or failed this request"
        else:
            queued = self.queued_prefill
            reason = (
                f"{'saturated' if ctx.home_backend == old else 'over the load bound'} (in flight "
                f"{', '.join(f'{b.name}={b.in_flight}' for b in candidates)}; prompt tokens in flight "
                f"on {old} {self.inflight_tokens.get(old, 0)}; prefill queued on {old} "
                f"{queued.get(old, 0)}, on {new} {queued.get(new, 0) - prefill}; "
                f"this request's there {prefill})"
            )
        turns = getattr(ctx.session, "turns", 0)  # admission counts this request already
        log.info("session %s turn %d moved %s -> %s: %s", ctx.session_key, turns - 1, old, new, reason)

    def _release(self, ctx_id: int) -> None:
        pending = self._pending.pop(ctx_id, None)
        if pending is None:
            return
        left = self.queued_prefill.get(pending.backend, 0) - pending.prefill
        self.queued_prefill[pending.backend] = max(left, 0)
        held = self.inflight_tokens.get(pending.backend, 0) - pending.tokens
        self.inflight_tokens[pending.backend] = max(held, 0)

    def _expire(self) -> None:
        deadline = time.monotonic() - self.pending_ttl
        while self._pending:
            ctx_id, oldest = next(iter(self._pending.items()))
            if oldest.since >= deadline:
                return
            self._release(ctx_id)

    def stats(self) -> dict[str, object]:
        """The index's stats and the prefill queued per rank."""
        return {"index": self.index.stats(), "queued_prefill": dict(self.queued_prefill)}
