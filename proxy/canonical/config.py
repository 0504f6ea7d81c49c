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
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from proxy.canonical.rules import RULE_ORDER
from proxy.canonical.rules.attribution import DEFAULT_HEADERS
from proxy.canonical.rules.env_block import BLOCK_NAMES
from proxy.canonical.rules.volatile_date import DEFAULT_PATTERNS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ToolOrderSettings(_Strict):
    """Rule 1: ``session`` = first-seen order per session; ``sort`` = by name, shared by all sessions."""

    enabled: bool = True
    mode: Literal["session", "sort"] = "session"
    # Without session state ``session`` mode cannot remember anything: sort, or keep the client's order.
    sessionless: Literal["sort", "keep"] = "sort"
    max_names: int = Field(default=1024, ge=1)


class SchemaKeyOrderSettings(_Strict):
    """Rule 2: canonical key order of tool envelopes and schema keywords."""

    enabled: bool = True


class DedupeToolsSettings(_Strict):
    """Rule 3: drop exact duplicates; same name with another definition: keep all or keep the first."""

    enabled: bool = True
    on_name_conflict: Literal["keep_all", "keep_first"] = "keep_all"


class AttributionLineSettings(_Strict):
    """Rule 4: header names whose ``name: k=v; ...`` lines are removed from system text."""

    enabled: bool = True
    headers: tuple[str, ...] = DEFAULT_HEADERS


class DatePattern(_Strict):
    """A named regex for a volatile date/time; its ``time`` group is what ``day`` mode removes.

    ``hints``: literal substrings (case-insensitive), one of which must occur for the regex to run;
    empty = always run.
    """

    name: str
    regex: str
    hints: tuple[str, ...] = ()

    @field_validator("regex")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as exc:
            raise ValueError(f"invalid regex: {exc}") from exc
        return value


def _default_date_patterns() -> tuple[DatePattern, ...]:
    return tuple(DatePattern(name=n, regex=r, hints=h) for n, (r, h) in DEFAULT_PATTERNS.items())


class VolatileDateSettings(_Strict):
    """Rule 5: ``day`` coarsens to the date, ``move`` moves the line to a user message."""

    enabled: bool = True
    mode: Literal["day", "move"] = "day"
    patterns: tuple[DatePattern, ...] = Field(default_factory=_default_date_patterns)
    # ``move`` mode: how many (message, line) attachments a session remembers.
    max_anchors: int = Field(default=8, ge=1)


class WhitespaceSettings(_Strict):
    """Rule 6: CRLF, trailing blanks, NFC and the final newline of system text."""

    enabled: bool = True
    # "keep": agents send their final newline consistently; forcing one would rewrite every request.
    final_newline: Literal["one", "strip", "keep"] = "keep"
    nfc: bool = True


class EnvBlockSettings(_Strict):
    """Rule 7 (opt-in): recognised environment blocks moved to a user message after the system."""

    enabled: bool = False
    blocks: tuple[Literal["env_tag", "cline_system_information"], ...] = BLOCK_NAMES  # type: ignore[assignment]


class RuleSettings(_Strict):
    """One settings object per rule; field names are the rule names used in metrics."""

    tool_order: ToolOrderSettings = ToolOrderSettings()
    schema_key_order: SchemaKeyOrderSettings = SchemaKeyOrderSettings()
    dedupe_tools: DedupeToolsSettings = DedupeToolsSettings()
    attribution_line: AttributionLineSettings = AttributionLineSettings()
    volatile_date: VolatileDateSettings = VolatileDateSettings()
    whitespace: WhitespaceSettings = WhitespaceSettings()
    env_block: EnvBlockSettings = EnvBlockSettings()


assert set(RuleSettings.model_fields) == set(RULE_ORDER), "every rule needs its settings"


def _deep_merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


class CanonicalOverride(_Strict):
    """A partial configuration: ``enabled`` and/or a per-rule patch of settings."""

    enabled: bool | None = None
    rules: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _patch_is_valid(self) -> CanonicalOverride:
        unknown = sorted(set(self.rules) - set(RULE_ORDER))
        if unknown:
            raise ValueError(f"unknown rules {unknown}; known: {list(RULE_ORDER)}")
        RuleSettings.model_validate(_deep_merge(RuleSettings().model_dump(), self.rules))
        return self


class CanonicalConfig(_Strict):
    """The canonicalizer's configuration (the ``canonical`` section of prefixgate's config)."""

    enabled: bool = True
    rules: RuleSettings = RuleSettings()
    models: dict[str, CanonicalOverride] = Field(default_factory=dict)
    clients: dict[str, CanonicalOverride] = Field(default_factory=dict)
    # Entries per cache (canonical system texts, canonical tool lists), per resolved rule set.
    cache_entries: int = Field(default=256, ge=1)

    def _model_override(self, model: str | None) -> CanonicalOverride | None:
        if model is None or not self.models:
            return None
        exact = self.models.get(model)
        if exact is not None:
            return exact
        for pattern, override in self.models.items():
            if fnmatchcase(model, pattern):
                return override
        return None

    def resolve(self, model: str | None, client_label: str | None) -> tuple[bool, RuleSettings]:
        """Whether canonicalization is on, and the rule settings, for this model and client label."""
        overrides = [self._model_override(model)]
        if client_label is not None:
            overrides.append(self.clients.get(client_label))
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
