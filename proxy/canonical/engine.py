"""The rule engine: ``Canonicalizer.apply`` rewrites a chat request into its canonical form.

The rules come from the configuration's ``RuleSettings`` (derived from the rule registry), in order
of application; each enabled rule is compiled into its step, by kind: message-list steps (run first,
over the whole message list), system-text steps (``proxy.canonical.messages``: the leading system
messages, and where what they take out goes) and tool steps (``proxy.canonical.tools``). The engine
knows no rule by name.

Every rule set the configuration can resolve to (the base rules, under each model override, each
client override and each pair of them) is compiled when the canonicalizer is made, at the gateway's
start: a request picks its compiled set (its model's override: the exact name, else the first
matching glob in configuration order; its client label's) and only runs steps.

Work is cached per resolved rule set: the canonical form of a system text is keyed by the text
itself, the stateless tool steps by a digest of the raw tools, so an unchanged prefix costs a hash and
a dict lookup per turn. Cached objects are shared between results: treat ``CanonResult.body`` as
read-only.

Determinism: no wall clock, no locale, no set or hash-randomized iteration reaches the output; the
only inputs are the body, the configuration and the session state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any, Literal

from proxy.canonical.config import CanonicalConfig, RuleSettings
from proxy.canonical.messages import TextSteps, canon_messages
from proxy.canonical.rules.base import (
    MessagesRule,
    MessagesStep,
    SessionToolsStep,
    TextRule,
    TextStep,
    ToolsRule,
    ToolsStep,
)
from proxy.canonical.state import SessionCanonState
from proxy.canonical.tools import ToolSteps

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CanonResult:
    """What ``Canonicalizer.apply`` returns.

    ``body`` is the rewritten request, or the very object passed in when ``changed`` is False.
    ``rewrites`` maps rule name -> number of rewrites that rule made in this request (only rules that
    made some).
    """

    body: Any
    changed: bool
    rewrites: dict[str, int]


class _RuleSet:
    """One resolved rule configuration: its enabled rules compiled into steps, with their caches."""

    def __init__(self, rules: RuleSettings, cache_entries: int) -> None:
        self.message_steps: list[tuple[str, MessagesStep]] = []
        text: list[tuple[str, TextStep]] = []
        tools: list[tuple[str, ToolsStep]] = []
        session_tools: list[tuple[str, SessionToolsStep]] = []
        for rule, settings in rules.items():
            if not settings.enabled:
                continue
            if isinstance(rule, MessagesRule):
                if (messages_step := rule.build(settings)) is not None:
                    self.message_steps.append((rule.name, messages_step))
            elif isinstance(rule, TextRule):
                if (text_step := rule.build(settings)) is not None:
                    text.append((rule.name, text_step))
            elif isinstance(rule, ToolsRule):
                if (tools_step := rule.build(settings)) is not None:
                    tools.append((rule.name, tools_step))
            elif (session_step := rule.build(settings)) is not None:
                session_tools.append((rule.name, session_step))
        self.texts = TextSteps(text, cache_entries) if text else None
        self.tools = ToolSteps(tools, session_tools, cache_entries) if tools or session_tools else None


class Canonicalizer:
    """Applies the configured rules to request bodies. One instance per process; cheap to call."""

    _MAX_RESOLVED = 4096

    def __init__(self, config: CanonicalConfig | None = None, *, strict: bool = False) -> None:
        """``strict`` re-raises internal errors instead of passing the body through (for tests)."""
        self.config = config = config if config is not None else CanonicalConfig()
        self._strict = strict
        compiled: dict[RuleSettings, _RuleSet] = {}  # one compiled set per distinct settings

        def compile_rules(model_key: str | None, client_key: str | None) -> _RuleSet | None:
            enabled, rules = config.rules_for(model_key, client_key)
            if not enabled:
                return None
            ruleset = compiled.get(rules)
            if ruleset is None:
                ruleset = compiled[rules] = _RuleSet(rules, config.cache_entries)
            return ruleset

        #: The compiled rule set (None: off) by the override keys of ``models`` and ``clients``.
        self._by_overrides: dict[tuple[str | None, str | None], _RuleSet | None] = {
            (model_key, client_key): compile_rules(model_key, client_key)
            for model_key in (None, *config.models)
            for client_key in (None, *config.clients)
        }
        #: The rule set of each (model, client label) seen: a glob is matched once per model name.
        self._resolved: dict[tuple[str | None, str | None], _RuleSet | None] = {}

    def _ruleset(self, model: str | None, client_label: str | None) -> _RuleSet | None:
        key = (model, client_label)
        if key in self._resolved:
            return self._resolved[key]
        models, clients = self.config.models, self.config.clients
        model_key = None
        if model is not None and models:
            if model in models:
                model_key = model
            else:
                model_key = next((pattern for pattern in models if fnmatchcase(model, pattern)), None)
        client_key = client_label if client_label is not None and client_label in clients else None
        ruleset = self._by_overrides[(model_key, client_key)]
        if len(self._resolved) >= self._MAX_RESOLVED:  # model names come from clients: stay bounded
            self._resolved.clear()
        self._resolved[key] = ruleset
        return ruleset

    def apply(
        self,
        body: Any,
        *,
        api: Literal["chat", "completions"],
        session: SessionCanonState | None = None,
        model: str | None = None,
        client_label: str | None = None,
    ) -> CanonResult:
        """Canonicalize an OpenAI chat-completions ``body``; never raises on any JSON value.

        Completions requests, non-dict bodies and disabled configurations pass through unchanged.
        ``session`` carries what rules remember across turns (first-seen tool order, pinned text).
        """
        unchanged = CanonResult(body, False, {})
        if api != "chat" or not isinstance(body, dict):
            return unchanged
        try:
            ruleset = self._ruleset(model, client_label)
            if ruleset is None:
                return unchanged
            rewrites: dict[str, int] = {}
            messages = body.get("messages")
            new_messages = None
            if isinstance(messages, list):
                for name, step in ruleset.message_steps:
                    edit = step(messages if new_messages is None else new_messages)
                    if edit.messages is not None:
                        new_messages = edit.messages
                        rewrites[name] = rewrites.get(name, 0) + edit.count
                if ruleset.texts is not None:
                    texts = canon_messages(
                        messages if new_messages is None else new_messages, ruleset.texts, session, rewrites
                    )
                    new_messages = texts if texts is not None else new_messages
            tools = body.get("tools")
            new_tools = None
            if isinstance(tools, list) and tools and ruleset.tools is not None:
                new_tools = ruleset.tools.apply(tools, session, rewrites)
        except Exception:
            if self._strict:
                raise
            log.exception("canonicalization failed; request passed through unchanged")
            return unchanged
        if new_messages is None and new_tools is None:
            return unchanged
        out = dict(body)
        if new_messages is not None:
            out["messages"] = new_messages
        if new_tools is not None:
            out["tools"] = new_tools
        return CanonResult(out, True, rewrites)
