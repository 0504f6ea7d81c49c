"""``CanonicalConfig``: which canonicalization rules run, in which mode, for which model and client.

Safe defaults: every low-risk rule on, ``volatile_date`` in ``day`` mode, ``env_block`` off. Overrides
per model (exact name, else the first matching glob in configuration order) and then per client key
label are deep-merged over the base rules::

    canonical:
      rules:
        volatile_date: {mode: move}
      models:
        "qwen3-*": {rules: {env_block: {enabled: true}}}
      clients:
        legacy-bot: {enabled: false}

The ``rules`` section is derived from the rule registry (``proxy.canonical.rules.REGISTRY``): one key
per registered rule, its settings model validating the value.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    create_model,
    model_validator,
)

from proxy.canonical.rules import REGISTRY
from proxy.canonical.rules.base import (
    MessagesRule,
    Rule,
    RuleConfig,
    SessionToolsRule,
    StrictModel,
    TextRule,
    ToolsRule,
)

__all__ = ["CanonicalConfig", "CanonicalOverride", "RuleSettings"]

S = TypeVar("S", bound=RuleConfig)

# The strict model of the section for one registry state: one field per rule, named after the rule
# (one entry per set of registered rules: the built-in set, plus the ones tests register).
_SECTION_MODELS: dict[tuple[Rule, ...], type[BaseModel]] = {}


def _section_model(rules: tuple[Rule, ...]) -> type[BaseModel]:
    model = _SECTION_MODELS.get(rules)
    if model is None:
        fields: dict[str, Any] = {r.name: (r.settings, Field(default_factory=r.settings)) for r in rules}
        model = create_model("RuleSettings", __base__=StrictModel, **fields)
        _SECTION_MODELS[rules] = model
    return model


class RuleSettings(BaseModel):
    """The ``canonical.rules`` section: one settings object per registered rule, named after the rule.

    Derived from ``REGISTRY`` when validated: every registered rule is there (its defaults when not
    given), an unknown rule name or an unknown key in a rule's settings is rejected. Frozen and
    hashable; ``model_dump`` gives the nested dicts; ``of(rule)`` / ``get(name)`` one rule's settings.
    """

    # The values are held as extras, one per rule name; what may be there is decided by the strict
    # section model in ``_by_registry`` (extra="forbid"), so unknown names never get this far.
    model_config = ConfigDict(extra="allow", frozen=True)

    _rules: tuple[Rule, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _by_registry(cls, data: Any, handler: ModelWrapValidatorHandler[RuleSettings]) -> RuleSettings:
        if isinstance(data, RuleSettings):
            return data
        rules = REGISTRY.rules
        section = _section_model(rules).model_validate(data)
        out = handler({r.name: getattr(section, r.name) for r in rules})
        out._rules = rules
        return out

    def __hash__(self) -> int:
        return hash(tuple((self.__pydantic_extra__ or {}).items()))

    def items(self) -> tuple[tuple[Rule, RuleConfig], ...]:
        """``(rule, its settings)`` in order of application."""
        extra = self.__pydantic_extra__ or {}
        return tuple((rule, extra[rule.name]) for rule in self._rules)

    def get(self, name: str) -> RuleConfig:
        """The settings of the rule named ``name``."""
        value = (self.__pydantic_extra__ or {})[name]
        assert isinstance(value, RuleConfig)
        return value

    def of(self, rule: MessagesRule[S] | TextRule[S] | ToolsRule[S] | SessionToolsRule[S]) -> S:
        """The settings of ``rule``, typed."""
        return cast(S, self.get(rule.name))


def _deep_merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


class CanonicalOverride(StrictModel):
    """A partial configuration: ``enabled`` and/or a per-rule patch of settings."""

    enabled: bool | None = None
    rules: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _patch_is_valid(self) -> CanonicalOverride:
        known = REGISTRY.names()
        unknown = sorted(set(self.rules) - set(known))
        if unknown:
            raise ValueError(f"unknown rules {unknown}; known: {list(known)}")
        RuleSettings.model_validate(_deep_merge(RuleSettings().model_dump(), self.rules))
        return self


class CanonicalConfig(StrictModel):
    """The canonicalizer's configuration (the ``canonical`` section of prefixgate's config)."""

    enabled: bool = True
    rules: RuleSettings = Field(default_factory=RuleSettings)
    models: dict[str, CanonicalOverride] = Field(default_factory=dict)
    clients: dict[str, CanonicalOverride] = Field(default_factory=dict)
    # Entries per cache (canonical system texts, canonical tool lists), per resolved rule set.
    cache_entries: int = Field(default=256, ge=1)

    def rules_for(self, model_key: str | None, client_key: str | None) -> tuple[bool, RuleSettings]:
        """Whether canonicalization is on, and the rule settings, under the override of ``models``
        named ``model_key`` and then that of ``clients`` named ``client_key`` (None: no override).
        Which override a request's model name falls under is the engine's choice
        (``Canonicalizer``: the exact name, else the first matching glob)."""
        overrides = [
            self.models[model_key] if model_key is not None else None,
            self.clients[client_key] if client_key is not None else None,
        ]
        active = [o for o in overrides if o is not None]
        if not active:
            return self.enabled, self.rules
        enabled = self.enabled
        merged = self.rules.model_dump()
        for override in active:
            if override.enabled is not None:
                enabled = override.enabled
            merged = _deep_merge(merged, override.rules)
        return enabled, RuleSettings.model_validate(merged)
