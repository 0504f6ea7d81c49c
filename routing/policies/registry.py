"""The registered policies by name: build one, or read what one needs without building it.

``routing.policies`` registers the built-in policies; a new policy is one new module and one
``register`` line there (or, for a policy living elsewhere, one ``register`` call in its module).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from routing.policies.protocol import Needs, PolicyOptions, RoutingPolicy

P = TypeVar("P", bound=type[RoutingPolicy])

_REGISTRY: dict[str, type[RoutingPolicy]] = {}
_OPTIONS = tuple(f.name for f in dataclasses.fields(PolicyOptions))


def register(policy: P) -> P:
    """Make ``policy`` known by its ``name`` (usable as a class decorator). Registering another
    class under a taken name is an error; registering the same class again is a no-op."""
    known = _REGISTRY.get(policy.name)
    if known is not None and known is not policy:
        raise ValueError(f"routing policy {policy.name!r} is registered already, by {known.__qualname__}")
    _REGISTRY[policy.name] = policy
    return policy


def unregister(name: str) -> None:
    """Forget the policy called ``name`` (tests registering their own); unknown names are ignored."""
    _REGISTRY.pop(name, None)


def policy_names() -> tuple[str, ...]:
    """The registered policies' names, in registration order (the default first)."""
    return tuple(_REGISTRY)


def policy_class(name: str) -> type[RoutingPolicy]:
    """The policy registered as ``name``; ValueError listing the registered names if there is none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; available: {', '.join(policy_names())}") from None


def needs_of(name: str) -> Needs:
    """What the policy called ``name`` needs computed before it routes, without building it."""
    return policy_class(name).needs


def make_policy(name: str, **options: Any) -> RoutingPolicy:
    """A new instance of the policy called ``name``.

    ``options`` are ``PolicyOptions`` fields (``balance_factor``); each policy uses those it knows.
    """
    policy = policy_class(name)
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise ValueError(f"unknown routing policy options {', '.join(unknown)}; known: {', '.join(_OPTIONS)}")
    if "balance_factor" in options:
        options["balance_factor"] = float(options["balance_factor"])
    return policy.from_options(PolicyOptions(**options))
