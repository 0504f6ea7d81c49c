"""The canonicalization rules, one module per rule, and the registry that lists them in order.

Each rule module defines ``RULE`` (see ``proxy.canonical.rules.base``: name, settings model, kind and
step). ``BUILTIN_RULES`` below is the order of application (``RULE_ORDER``): the message-list rules,
then the system-text rules, per text, then the tool rules. ``whitespace`` runs after the rules that
edit text in place so that what they cut out leaves no ragged edges; the rules moving an agent's
whole volatile section (``proxy.canonical.rules.sections``) come after it and leave none themselves.

Adding a rule: write ``proxy/canonical/rules/<module>.py`` with its ``RULE``, import the module here
and put ``<module>.RULE`` in ``BUILTIN_RULES`` at its place. The ``canonical.rules`` configuration
section (``RuleSettings``) then validates its settings under its name, per model and per client too,
and its rewrites are counted under that name. ``REGISTRY.register`` adds a rule at run time (tests,
extensions).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from pydantic import BaseModel

from proxy.canonical.rules import (
    attribution,
    claude_environment,
    claude_git_status,
    claude_memory,
    dedupe_tools,
    env_block,
    late_system,
    opencode_env,
    param_order,
    schema_keys,
    tool_order,
    volatile_date,
    whitespace,
)
from proxy.canonical.rules.base import Rule

BUILTIN_RULES: tuple[Rule, ...] = (
    late_system.RULE,
    attribution.RULE,
    volatile_date.RULE,
    env_block.RULE,
    whitespace.RULE,
    claude_git_status.RULE,
    claude_environment.RULE,
    claude_memory.RULE,
    opencode_env.RULE,
    schema_keys.RULE,
    dedupe_tools.RULE,
    tool_order.RULE,
    param_order.RULE,
)


class Registry:
    """The registered rules, in order of application. Names are unique; order is by registration."""

    def __init__(self, rules: Iterable[Rule] = ()) -> None:
        self._rules: tuple[Rule, ...] = ()
        for rule in rules:
            self.register(rule)

    @property
    def rules(self) -> tuple[Rule, ...]:
        """The rules, in order of application."""
        return self._rules

    def names(self) -> tuple[str, ...]:
        """The rule names, in order of application."""
        return tuple(rule.name for rule in self._rules)

    def register(self, rule: Rule, *, before: str | None = None) -> None:
        """Add ``rule`` last, or just before the rule named ``before``."""
        name = rule.name
        if not name.isidentifier() or name.startswith("_") or hasattr(BaseModel, name):
            raise ValueError(f"rule name {name!r} cannot be a configuration key")
        if name in self.names():
            raise ValueError(f"a rule named {name!r} is already registered")
        at = len(self._rules) if before is None else self.names().index(before)
        self._rules = (*self._rules[:at], rule, *self._rules[at:])

    def unregister(self, name: str) -> None:
        """Remove the rule named ``name`` (configurations validated before keep it)."""
        if name not in self.names():
            raise KeyError(name)
        self._rules = tuple(rule for rule in self._rules if rule.name != name)

    @contextmanager
    def registered(self, rule: Rule, *, before: str | None = None) -> Iterator[Rule]:
        """``rule`` registered for the duration of a ``with`` block."""
        self.register(rule, before=before)
        try:
            yield rule
        finally:
            self.unregister(rule.name)


REGISTRY = Registry(BUILTIN_RULES)

RULE_ORDER: tuple[str, ...] = tuple(rule.name for rule in BUILTIN_RULES)

__all__ = ["BUILTIN_RULES", "REGISTRY", "RULE_ORDER", "Registry"]
