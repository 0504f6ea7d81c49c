"""Prefix affinity (the default): the rank that already holds the most of the prompt, load-bounded.

Per candidate rank ``r``, with ``hit_r`` the tokens of the prompt's leading blocks the index says
``r`` holds, weighed by tier (``bounds.tier_weighed_hit``: a block ``r`` holds in CPU memory only
saves its prefill minus loading it back, at ``r``'s measured load cost), ``head`` the prompt's
leading tokens every session of its agent shares (system prompt and tools), ``P`` the prompt's
tokens and ``w_r`` what a token of prefill costs on ``r`` against the other ranks (its measured
seconds per token over their mean; 1 while not measured)::

    own_r   = hit_r - head                         (the session's own blocks there, at least 0)
    score_r = own_r - w_r x (queued_prefill_r + P - hit_r)      (``bounds.placement_score``)

i.e. minus the prefill ``r`` computes before this request's first token (what is queued there, the
uncached tokens of its requests in flight, then this request's miss), plus the session's own blocks
once more: moving a session off them recomputes them and leaves a dead copy crowding the pool. A
hit on the shared head saves its prefill once and nothing more, since the rank that computes it
holds it too: a new session goes to the rank holding its agent's head only while the head saves
more than the prefill queued there costs, so a wave of first turns spreads over idle ranks instead
of queueing behind each other on the head's rank, while small ones still share it. The comparison
is in tokens weighed by the ranks' own measured speeds, so a replay compressed in time behaves
alike. A rank is eligible only while its in-flight requests stay within ``balance_factor`` x the
fleet mean (CHWBL), checked per candidate; there is no fleet-wide "imbalanced, stop being sticky"
switch.

- A session admission has accounted on a rank (``home_rank``: admitted and active) stays there
  unless the rank is down. Admission already keeps each rank's sessions within its pool; moving
  one for load would recompute its whole context and crowd the other rank's pool. Neither the load
  bound nor the queued prefill applies to it. With an unknown pool (``bounds.saturated``), over the load bound
  it leaves for a rank that scores better (below) even though it must recompute its context there.
- Any other known session (not homed: no admission, or its rank lost most of its blocks) stays on
  its rank while that rank is eligible; over the bound it leaves only for an eligible rank that
  scores better, as a saturated home does. The bound counts requests, not what they cost: on two
  ranks, two requests in flight on one and none on the other put the first over it, and moving a
  session of 85k tokens for that recomputed all of them (on replays at 1.9x the pools, leaving only
  where the score says so raised the hit rate from 0.587 to 0.612 and cut TTFT p50 from 74 to 58 ms,
  medians of 3 rounds).
- Otherwise (a new session, or its rank is gone) the best-scoring eligible rank wins.
- Ties (e.g. no blocks known yet) go to the rank with fewer requests in flight, then to the
  session's rendezvous-hash favourite, so every replica breaks them the same way.

The order after the first (where a retry goes) follows the same logic: the best-scoring eligible
ranks, then those over the bound, each by score.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from routing.policies.bounds import (
    DEFAULT_BALANCE_FACTOR,
    load_bound,
    max_hit_blocks,
    placement_score,
    prompt_size,
    rendezvous_order,
    saturated,
    tier_weighed_hit,
    token_weights,
    within_bound,
)
from routing.policies.protocol import Needs, PolicyOptions, RouteRequest
from routing.ranks import Rank


class PrefixAffinity:
    name: ClassVar[str] = "prefix_affinity"
    needs: ClassVar[Needs] = Needs(blocks=True, prefix_index=True)

    def __init__(self, balance_factor: float = DEFAULT_BALANCE_FACTOR) -> None:
        if balance_factor < 1.0:
            raise ValueError("balance_factor must be >= 1")
        self.balance_factor = balance_factor

    @classmethod
    def from_options(cls, options: PolicyOptions) -> PrefixAffinity:
        return cls(balance_factor=options.balance_factor)

    def order(self, request: RouteRequest, candidates: Sequence[Rank]) -> list[Rank]:
        bound = load_bound(candidates, self.balance_factor)
        size = request.block_size
        full = len(request.block_hashes)
        prompt = prompt_size(request.prompt_tokens, full, size)
        home = None  # the session's rank, when it has one among the candidates
        first = None
        if request.home_rank is not None:
            home = next((r for r in candidates if r.name == request.home_rank), None)
            if home is not None and not saturated(home, bound):
                first = home
        elif request.session_rank is not None:
            home = next((r for r in candidates if r.name == request.session_rank), None)
            if home is not None and within_bound(home, bound):
                first = home
        cap = max_hit_blocks(request.prompt_tokens, full, size)
        matched = request.matched_blocks
        queued = request.queued_prefill
        key = request.session_key or ""
        head = request.head_tokens
        weights = token_weights(candidates, request.seconds_per_token)
        offloaded, costs = request.offloaded_blocks, request.cpu_load_costs

        def rank_key(r: Rank) -> tuple[float, int, int]:
            held = matched.get(r.name, 0)
            hit = tier_weighed_hit(min(held, cap), held, offloaded.get(r.name, 0), size, costs.get(r.name))
            score = placement_score(hit, head, prompt, queued.get(r.name, 0), weights[r.name])
            return (score, -r.in_flight, rendezvous_order(key, r))

        scores = {r.name: rank_key(r) for r in candidates}

        # Eligible: within the bound; when no rank is, every rank (the best of all wins).
        any_within = any(within_bound(r, bound) for r in candidates)

        def eligible(r: Rank) -> bool:
            return not any_within or within_bound(r, bound)

        # sorted() is stable: equal keys keep the candidates' order, so the first is what max() picks.
        if first is None and home is not None:
            # Saturated, or over the bound: leave only for a rank that scores better than home,
            # where a token of its own to recompute weighs twice a token queued (it is both prefill
            # now and cache the session loses). Ineligible ranks other than home come last.
            return sorted(
                [home, *(r for r in candidates if r is not home)],
                key=lambda r: (r is home or eligible(r), scores[r.name][0], r is home),
                reverse=True,
            )
        ranked = sorted(candidates, key=lambda r: (eligible(r), scores[r.name]), reverse=True)
        if first is not None:
            ranked.remove(first)
            ranked.insert(0, first)
        return ranked
