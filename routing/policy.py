"""The routing policy interface: one policy per module, all behind ``RoutingPolicy``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from routing.backends import Backend


@dataclass(slots=True)
class RouteRequest:
    """What a policy may look at to choose a rank."""

    session_key: str | None = None
    prompt_tokens: int | None = None
    block_hashes: Sequence[bytes] = field(default_factory=tuple)


class RoutingPolicy(Protocol):
    """Chooses one of ``candidates`` (healthy ranks, never empty) for a request."""

    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Backend]) -> Backend: ...


def make_policy(name: str) -> RoutingPolicy:
    """The policy called ``name``; a new policy is one new module plus one line here."""
    if name == "round_robin":
        from routing.round_robin import RoundRobin

        return RoundRobin()
    raise ValueError(f"unknown routing policy {name!r}; available: round_robin")
