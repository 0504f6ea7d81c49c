"""Prefix affinity (the default): the rank that already holds the most of the prompt, load-bounded.

Per candidate rank ``b``, with ``hit_b`` the tokens of the prompt's leading blocks the index says
``b`` holds and ``P`` the prompt's tokens::

    score_b = hit_b - (P - hit_b) - queued_prefill_b

i.e. expected hit tokens minus the load it would cost: the prefill this request would need there
plus the prefill already queued there. A rank is eligible only while its in-flight requests stay
within ``balance_factor`` x the fleet mean (CHWBL), checked per candidate; there is no fleet-wide
"imbalanced, stop being sticky" switch.

- A session admission has accounted on a rank (``home_backend``: admitted and active) stays there
  unless the rank is down, or truly saturated (``routing.policy.saturated``: its requests in flight
  fill its pool) and another rank scores better (below) even though the session must recompute its
  context there. Admission already keeps each rank's sessions within its pool; moving one for
  load would recompute its whole context and crowd the other rank's pool. The load bound does not
  apply to it.
- Any other known session stays on its rank while that rank is eligible.
- Otherwise (new session, or its rank is over the bound or gone) the best-scoring eligible rank
  wins: a new session whose system prompt and tools are already held somewhere goes there.
- Ties (e.g. no blocks known yet) go to the rank with fewer requests in flight, then to the
  session's rendezvous-hash favourite, so every replica breaks them the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

from routing.policy import (
    DEFAULT_BALANCE_FACTOR,
    RouteRequest,
    load_bound,
    prompt_size,
    rendezvous_order,
    saturated,
    within_bound,
)
from routing.ranks import Rank


def max_hit_blocks(prompt_tokens: int | None, full_blocks: int, block_size: int) -> int:
    """vLLM recomputes the prompt's last token, so at most ``(N - 1) // block_size`` blocks can hit."""
    if prompt_tokens is None:
        return full_blocks
    return min(full_blocks, max(prompt_tokens - 1, 0) // block_size)


class PrefixAffinity:
    name = "prefix_affinity"
    uses_blocks = True  # needs the prompt's blocks (or at least its token count)

    def __init__(self, balance_factor: float = DEFAULT_BALANCE_FACTOR) -> None:
        if balance_factor < 1.0:
            raise ValueError("balance_factor must be >= 1")
        self.balance_factor = balance_factor

    def choose(self, request: RouteRequest, candidates: Sequence[Rank]) -> Rank:
        bound = load_bound(candidates, self.balance_factor)
        home = None
        if request.home_backend is not None:
            home = next((b for b in candidates if b.name == request.home_backend), None)
            if home is not None and not saturated(request, home, bound):
                return home
        elif request.session_backend is not None:
            for b in candidates:
                if b.name == request.session_backend and within_bound(b, bound):
                    return b
        eligible = [b for b in candidates if within_bound(b, bound)] or list(candidates)
        size = request.block_size
        full = len(request.block_hashes)
        cap = max_hit_blocks(request.prompt_tokens, full, size)
        prompt = prompt_size(request.prompt_tokens, full, size)
        matched = request.matched_blocks
        queued = request.queued_prefill
        key = request.session_key or ""

        def rank(b: Rank) -> tuple[int, int, int]:
            hit = min(matched.get(b.name, 0), cap) * size
            score = hit - (prompt - hit) - queued.get(b.name, 0)
            return (score, -b.in_flight, rendezvous_order(key, b))

        if home is None:
            return max(eligible, key=rank)
        # saturated: leave only for a rank that scores better than home, where a token to recompute
        # weighs twice a token queued (it is both prefill now and cache the session loses)
        return max([home, *(b for b in eligible if b is not home)], key=lambda b: (rank(b)[0], b is home))
