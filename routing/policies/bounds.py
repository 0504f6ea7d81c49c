"""The math the policies share: CHWBL's load bound, saturation, prompt sizes, what a rank's queued
prefill costs a request against what its cache saves, the rendezvous tie-break.

Pure functions of numbers and ``Rank``s: no policy, no request, no registry, so every policy module
(and the router) can import them without pulling anything else in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import xxhash

from routing.index import offloaded_within
from routing.ranks import Rank

#: CHWBL's load bound: a rank takes a request only while its load stays within this factor of the mean.
DEFAULT_BALANCE_FACTOR = 1.25

#: A rank with fewer requests in flight than this is never over the bound: at low load CHWBL's bound
#: (ceil(1.25 x 1/4) = 1 with one request in a 4-rank fleet) would forbid a session's second
#: concurrent request (a sub-agent, a retry) from joining its cache.
MIN_BOUND = 2


def load_bound(candidates: Sequence[Rank], factor: float) -> int:
    """CHWBL's bound: the most requests in flight a rank may have and still take one more."""
    total = sum(r.in_flight for r in candidates)
    return max(MIN_BOUND, math.ceil(factor * (total + 1) / len(candidates)))


def within_bound(rank: Rank, bound: int) -> bool:
    return rank.in_flight + 1 <= bound


def prompt_size(prompt_tokens: int | None, full_blocks: int, block_size: int) -> int:
    """The prompt's tokens; without a count (no blocks stage), those of its ``full_blocks``."""
    return prompt_tokens if prompt_tokens is not None else full_blocks * block_size


def max_hit_blocks(prompt_tokens: int | None, full_blocks: int, block_size: int) -> int:
    """vLLM recomputes the prompt's last token, so at most ``(N - 1) // block_size`` blocks can hit."""
    if prompt_tokens is None:
        return full_blocks
    return min(full_blocks, max(prompt_tokens - 1, 0) // block_size)


def saturated(home: Rank, bound: int) -> bool:
    """Whether an admitted session's ``home`` rank is too loaded to keep it: with an unknown pool,
    over the CHWBL ``bound``; with a known pool never here, since admission keeps the rank's sessions
    within its pool.

    A rank that merely has more requests in flight than the others batches them; moving a session
    off it recomputes the session's whole context elsewhere, crowds the other rank's pool behind
    admission's back and leaves a dead copy behind. It was once judged saturated when its requests
    in flight filled its pool: on replays over capacity that moved 22 of 40 sessions, halved the
    hit rate's gain and made turns slower (``tests/helpers/replica_replay.py``; the closing note of stop 30).
    """
    return not home.pool_tokens and not within_bound(home, bound)


#: What loading a token back from a rank's CPU memory costs against prefilling it there, until the
#: rank has said (``RankSpeeds.cpu_load_costs``: it reports no offload load counters, or has not
#: loaded enough yet): 0.2, i.e. a CPU-held block saves 0.8 of a GPU-held one, the weight llm-d's
#: precise prefix scorer gives it (Dynamo's router: 0.75).
CPU_LOAD_COST_PRIOR = 0.2


def tier_weighed_hit(
    hit_blocks: int, matched: int, offloaded: int, block_size: int, load_cost: float | None
) -> float:
    """The prefill, in tokens, that a rank holding ``hit_blocks`` of the prompt's leading blocks
    saves: a block with a GPU copy saves its prefill, one held in CPU memory only saves its prefill
    minus loading it back (``load_cost`` per token against prefill; None: the prior). ``matched``
    and ``offloaded``: the rank's whole match and its CPU-only blocks (``Lookup``)."""
    cpu = offloaded_within(matched, offloaded, hit_blocks)
    cost = CPU_LOAD_COST_PRIOR if load_cost is None else min(max(load_cost, 0.0), 1.0)
    return (hit_blocks - cost * cpu) * block_size


def token_weights(candidates: Sequence[Rank], seconds_per_token: Mapping[str, float]) -> dict[str, float]:
    """What a token of prefill costs on each candidate against the others: its measured seconds per
    token over the mean of the candidates measured. A rank not measured weighs 1 (the mean), and
    with none measured every rank does: the comparison stays in tokens. A ratio of the ranks' own
    speeds, so it holds as is on a replay compressed in time."""
    measured = [s for r in candidates if (s := seconds_per_token.get(r.name)) is not None and s > 0]
    if not measured:
        return dict.fromkeys((r.name for r in candidates), 1.0)
    mean = sum(measured) / len(measured)
    return {r.name: (s / mean if (s := seconds_per_token.get(r.name)) and s > 0 else 1.0) for r in candidates}


def placement_score(hit: float, head: int, prompt: int, queued: int, weight: float = 1.0) -> float:
    """What sending a request of ``prompt`` tokens to a rank is worth, in tokens of prefill at the
    fleet's mean speed: the session's own blocks the rank holds, minus the prefill the rank computes
    before this request's first token there (vLLM schedules first come, first served): the
    ``queued`` prefill of its requests in flight, then this request's miss, at the rank's
    ``weight`` (``token_weights``).

    ``hit`` is what the rank holds of the prompt, ``head`` the leading tokens every session of the
    agent shares. A hit on the head saves its prefill now and nothing more: once any rank computed
    it, that rank holds it too, so a new session goes where the head is only while the head's
    tokens outweigh the queue there (a wave of first turns spreads once the head's rank has more
    prefill queued than the head saves). The session's own blocks beyond the head count twice:
    going elsewhere recomputes them now and leaves a dead copy crowding the pool.
    """
    own = max(hit - head, 0)
    return own - weight * (queued + prompt - hit)


def rendezvous_order(key: str, rank: Rank) -> int:
    """A per-(key, rank) weight every replica computes alike: ties break the same way everywhere."""
    return xxhash.xxh3_64_intdigest(f"{key}\x00{rank.name}".encode())
