"""The routing policy interface: one policy per module, all behind ``RoutingPolicy``."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import xxhash

from routing.ranks import Rank

#: CHWBL's load bound: a rank takes a request only while its load stays within this factor of the mean.
DEFAULT_BALANCE_FACTOR = 1.25

#: A rank with fewer requests in flight than this is never over the bound: at low load CHWBL's bound
#: (ceil(1.25 x 1/4) = 1 with one request in a 4-rank fleet) would forbid a session's second
#: concurrent request (a sub-agent, a retry) from joining its cache.
MIN_BOUND = 2

POLICIES = ("prefix_affinity", "session_hash", "least_loaded", "round_robin")


@dataclass(slots=True)
class RouteRequest:
    """What a policy may look at to choose a rank (the router fills in the index's view)."""

    session_key: str | None = None
    prompt_tokens: int | None = None
    block_hashes: Sequence[bytes] = field(default_factory=tuple)
    #: Leading blocks of the prompt each backend (by name) probably holds.
    matched_blocks: Mapping[str, int] = field(default_factory=dict)
    #: The backend this session was last sent to, if known.
    session_backend: str | None = None
    block_size: int = 16
    #: Prefill tokens routed to each backend (by name) and not answered yet.
    queued_prefill: Mapping[str, int] = field(default_factory=dict)
    #: The backend admission accounts this (admitted, active) session on: sticky policies keep it
    #: there while it is healthy and not saturated (see ``saturated``), whatever the load bound says.
    home_backend: str | None = None
    #: Prompt tokens of the requests routed to each backend (by name) and not answered yet: KV the
    #: rank must hold for them, whatever is cached.
    inflight_tokens: Mapping[str, int] = field(default_factory=dict)


class RoutingPolicy(Protocol):
    """Chooses one of ``candidates`` (healthy ranks, never empty) for a request."""

    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Rank]) -> Rank: ...


def load_bound(candidates: Sequence[Rank], factor: float) -> int:
    """CHWBL's bound: the most requests in flight a rank may have and still take one more."""
    total = sum(b.in_flight for b in candidates)
    return max(MIN_BOUND, math.ceil(factor * (total + 1) / len(candidates)))


def prompt_size(prompt_tokens: int | None, full_blocks: int, block_size: int) -> int:
    """The prompt's tokens; without a count (no blocks stage), those of its ``full_blocks``."""
    return prompt_tokens if prompt_tokens is not None else full_blocks * block_size


def within_bound(backend: Rank, bound: int) -> bool:
    return backend.in_flight + 1 <= bound


def saturated(request: RouteRequest, home: Rank, bound: int) -> bool:
    """Whether an admitted session's ``home`` rank is truly saturated: the requests in flight there
    and this one need more KV than its pool, so it would queue this request (or preempt) whatever it
    has cached. With an unknown pool: over the CHWBL ``bound``.

    A rank that merely has more requests in flight than the others batches them; moving a session
    off it recomputes the session's whole context elsewhere, crowds the other rank's pool behind
    admission's back and leaves a dead copy behind.
    """
    if not home.pool_tokens:
        return not within_bound(home, bound)
    prompt = prompt_size(request.prompt_tokens, len(request.block_hashes), request.block_size)
    return request.inflight_tokens.get(home.name, 0) + prompt > home.pool_tokens


def rendezvous_order(key: str, backend: Rank) -> int:
    """A per-(key, backend) weight every replica computes alike: ties break the same way everywhere."""
    return xxhash.xxh3_64_intdigest(f"{key}\x00{backend.name}".encode())


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    """The policy called ``name``; a new policy is one new module plus one line here.

    ``options``: ``balance_factor`` (prefix_affinity, session_hash).
    """
    factor = float(options.get("balance_factor", DEFAULT_BALANCE_FACTOR))
    if name == "round_robin":
        from routing.round_robin import RoundRobin

        return RoundRobin()
    if name == "least_loaded":
        from routing.least_loaded import LeastLoaded

        return LeastLoaded()
    if name == "session_hash":
        from routing.session_hash import SessionHash

        return SessionHash(balance_factor=factor)
    if name == "prefix_affinity":
        from routing.prefix_affinity import PrefixAffinity

        return PrefixAffinity(balance_factor=factor)
    raise ValueError(f"unknown routing policy {name!r}; available: {', '.join(POLICIES)}")
