"""Canonicalization of chat requests: byte-stable system prompts and tools across turns and sessions.

Public API::

    canon = Canonicalizer(CanonicalConfig.model_validate(cfg))
    result = canon.apply(body, api="chat", session=state, model=model, client_label=label)
    result.body, result.changed, result.rewrites   # rewrites: rule name -> count

``SessionCanonState`` is the per-session state protocol (``InMemorySessionCanonState`` here, a Redis
one with the session store); ``split_parts`` names the parts of a request for the break explainer.

The rules live in ``proxy.canonical.rules``, one module each, listed in order of application by its
registry (``RULE_ORDER``); ``proxy.canonical.rules.base`` is the rule interface.
"""

from __future__ import annotations

from proxy.canonical.config import CanonicalConfig, CanonicalOverride, RuleSettings
from proxy.canonical.engine import Canonicalizer, CanonResult
from proxy.canonical.parts import RequestPart, first_differing_line, first_differing_part, split_parts
from proxy.canonical.rules import RULE_ORDER
from proxy.canonical.rules.volatile_date import DatePattern
from proxy.canonical.state import InMemorySessionCanonState, SessionCanonState

__all__ = [
    "RULE_ORDER",
    "CanonResult",
    "CanonicalConfig",
    "CanonicalOverride",
    "Canonicalizer",
    "DatePattern",
    "InMemorySessionCanonState",
    "RequestPart",
    "RuleSettings",
    "SessionCanonState",
    "first_differing_line",
    "first_differing_part",
    "split_parts",
]
