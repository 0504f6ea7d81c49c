"""Stage 6, pick a rank: ask the configured policy among the healthy ranks not yet tried."""

from __future__ import annotations

from collections.abc import Collection

from proxy.context import RequestContext
from proxy.errors import no_healthy_backend
from routing.backends import Backend, BackendPool
from routing.policy import RouteRequest, RoutingPolicy


class Router:
    def __init__(self, pool: BackendPool, policy: RoutingPolicy) -> None:
        self.pool = pool
        self.policy = policy

    def pick(self, ctx: RequestContext | None, tried: Collection[str] = ()) -> Backend:
        candidates = self.pool.healthy(exclude=tried)
        if not candidates:
            raise no_healthy_backend()
        if len(candidates) == 1:
            return candidates[0]
        request = (
            RouteRequest()
            if ctx is None
            else RouteRequest(ctx.session_key, ctx.prompt_tokens, ctx.block_hashes)
        )
        return self.policy.choose(request, candidates)

    def observe(self, ctx: RequestContext, backend: Backend, cached_tokens: int | None) -> None:
        """After the answer: what the rank reported (``cached_tokens``; None when it did not say).

        The prefix index's hook for recording the request's blocks and correcting its mirror.
        """
        return None
