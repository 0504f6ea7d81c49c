"""Routing policies: one module per policy, all behind ``RoutingPolicy`` (``protocol.py``).

- ``protocol.py``: the interface (``RoutingPolicy``, ``Needs``), its input (``RouteRequest``) and
  the options a policy is built with (``PolicyOptions``);
- ``bounds.py``: the math policies share (CHWBL load bound, saturation, prompt sizes, tie-break);
- ``registry.py``: policies by name (``register``, ``make_policy``, ``needs_of``, ``policy_names``);
- one module per policy, registered below in the order the help text lists them (the default first).

To add a policy: write ``routing/policies/<name>.py`` with a class implementing ``RoutingPolicy``
(class attributes ``name`` and ``needs``, ``from_options``, ``order``), import it here and add it
to ``BUILTIN``.
"""

from __future__ import annotations

from routing.policies.least_loaded import LeastLoaded
from routing.policies.prefix_affinity import PrefixAffinity
from routing.policies.protocol import Needs, PolicyOptions, RouteRequest, RoutingPolicy
from routing.policies.registry import (
    make_policy,
    needs_of,
    policy_class,
    policy_names,
    register,
    unregister,
)
from routing.policies.round_robin import RoundRobin
from routing.policies.session_hash import SessionHash

#: The built-in policies, in the order the help text lists them; the first is the default.
BUILTIN: tuple[type[RoutingPolicy], ...] = (PrefixAffinity, SessionHash, LeastLoaded, RoundRobin)
for _policy in BUILTIN:
    register(_policy)

#: The built-in policies' names (``policy_names()`` also lists policies registered later).
POLICIES: tuple[str, ...] = tuple(p.name for p in BUILTIN)
DEFAULT_POLICY = POLICIES[0]

__all__ = [
    "BUILTIN",
    "DEFAULT_POLICY",
    "POLICIES",
    "LeastLoaded",
    "Needs",
    "PolicyOptions",
    "PrefixAffinity",
    "RoundRobin",
    "RouteRequest",
    "RoutingPolicy",
    "SessionHash",
    "make_policy",
    "needs_of",
    "policy_class",
    "policy_names",
    "register",
    "unregister",
]
