"""The one interface every routing policy implements, and what a policy is given.

A policy is a class with two pieces of class-level data, readable without an instance (the
pipeline reads them to decide which stages to run before routing), a constructor from options, and
one method that ranks the candidates::

    class RoundRobin:
        name: ClassVar[str] = "round_robin"
        needs: ClassVar[Needs] = Needs()

        @classmethod
        def from_options(cls, options: PolicyOptions) -> RoundRobin: ...

        def order(self, request: RouteRequest, candidates: Sequence[Rank]) -> list[Rank]: ...
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, Self

from routing.policies.bounds import DEFAULT_BALANCE_FACTOR
from routing.ranks import Rank


@dataclass(frozen=True, slots=True)
class Needs:
    """What a policy needs computed before it routes."""

    #: The prompt's block hashes and token count: the tokenize-and-hash stage must run.
    blocks: bool = False
    #: The prefix index's view (``RouteRequest.matched_blocks`` and ``session_rank``).
    prefix_index: bool = False


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """Every option a policy may be built with; each policy reads the ones it uses."""

    #: CHWBL's load bound factor (prefix_affinity, session_hash).
    balance_factor: float = DEFAULT_BALANCE_FACTOR


@dataclass(slots=True)
class RouteRequest:
    """What a policy may look at to order the ranks (the router fills in the index's view)."""

    session_key: str | None = None
    prompt_tokens: int | None = None
    block_hashes: Sequence[bytes] = field(default_factory=tuple)
    #: Leading blocks of the prompt each rank (by name) probably holds.
    matched_blocks: Mapping[str, int] = field(default_factory=dict)
    #: The rank this session was last sent to, if known.
    session_rank: str | None = None
    block_size: int = 16
    #: Prefill tokens routed to each rank (by name) and not answered yet.
    queued_prefill: Mapping[str, int] = field(default_factory=dict)
    #: The rank admission accounts this (admitted, active) session on: sticky policies keep it there
    #: while it is healthy and not saturated (see ``bounds.saturated``), whatever the load bound says.
    home_rank: str | None = None
    #: Prompt tokens of the requests routed to each rank (by name) and not answered yet: KV the rank
    #: must hold for them, whatever is cached.
    inflight_tokens: Mapping[str, int] = field(default_factory=dict)
    #: Leading tokens of the prompt that every session of its agent shares (system prompt and tools,
    #: ``PromptBlocks.head``): a rank holding them saves this request their prefill, but says nothing
    #: of where the session itself lives.
    head_tokens: int = 0
    #: Each rank's measured seconds of prefill per computed token (by name; a rank not measured is
    #: missing): what a token queued there costs in time.
    seconds_per_token: Mapping[str, float] = field(default_factory=dict)
    #: Of each rank's matched blocks, how many it holds in CPU memory only (``Lookup.offloaded``):
    #: they hit, but are loaded back instead of read in place.
    offloaded_blocks: Mapping[str, int] = field(default_factory=dict)
    #: Each rank's measured cost of loading a token back from CPU memory against prefilling it
    #: (``PrefillSpeeds.cpu_load_costs``; a rank not measured is missing and weighs the prior).
    cpu_load_costs: Mapping[str, float] = field(default_factory=dict)


class PrefillSpeeds(Protocol):
    """The ranks' measured prefill speeds, as routing reads them into ``seconds_per_token``
    (admission's ``RankSpeeds``, fed by the ranks' own ``/metrics``)."""

    def measured(self) -> Mapping[str, float]:
        """Seconds of prefill per computed token, per rank measured so far."""
        ...

    def cpu_load_costs(self) -> Mapping[str, float]:
        """Per rank measured so far: seconds to load a token back from CPU memory over seconds to
        prefill one."""
        ...


class RoutingPolicy(Protocol):
    """Orders ``candidates`` (healthy ranks, never empty) for a request, most preferred first."""

    #: The name the settings, the CLI and ``make_policy`` know the policy by.
    name: ClassVar[str]
    #: What the pipeline must compute before this policy routes.
    needs: ClassVar[Needs]

    @classmethod
    def from_options(cls, options: PolicyOptions) -> Self:
        """The policy built with ``options`` (ignoring those it does not use)."""
        ...

    def order(self, request: RouteRequest, candidates: Sequence[Rank]) -> list[Rank]:
        """Every candidate once, in the order to try them: the first is the choice, the rest are
        where a retry goes next. A policy's state (a rotation) advances once per call: one call
        per routed request, however many of the candidates are tried."""
        ...
