"""The rule engine: ``Canonicalizer.apply`` rewrites a chat request into its canonical form.

Only the leading system messages and ``tools`` are rewritten (plus, in ``volatile_date`` ``move`` mode
and with ``env_block``, one user message each), never the rest of the history, so the cost does not
grow with the conversation. Work is cached per resolved rule set: the canonical form of a system text
is keyed by the text itself, the stateless part of the tool rules by a digest of the raw tools, so an
unchanged prefix costs a hash and a dict lookup per turn. Cached objects are shared between results:
treat ``CanonResult.body`` as read-only.

Determinism: no wall clock, no locale, no set or hash-randomized iteration reaches the output; the
only inputs are the body, the configuration and the session state.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
import xxhash

from proxy.canonical.config import CanonicalConfig, RuleSettings
from proxy.canonical.rules import TEXT_RULES, attribution, dedupe_tools, env_block, schema_keys, tool_order
from proxy.canonical.rules import volatile_date as vdate
from proxy.canonical.rules import whitespace as ws
from proxy.canonical.state import SessionCanonState
from tokenization.lru import LRU

log = logging.getLogger(__name__)

SYSTEM_ROLES = frozenset({"system", "developer"})
_MAX_ROUNDS = 4

# A text step: text -> (new text, rewrite count, text taken out of the system prompt).
TextStep = Callable[[str], tuple[str, int, tuple[str, ...]]]


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


@dataclass(frozen=True, slots=True)
class TextOutcome:
    """The canonical form of one system text: the text, per-rule counts and what was taken out."""

    text: str
    counts: tuple[tuple[str, int], ...]
    moved_lines: tuple[str, ...]
    env_blocks: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _ToolsOutcome:
    tools: tuple[Any, ...]
    names: tuple[str, ...] | None  # None when some tool has no function name: order is left alone
    counts: tuple[tuple[str, int], ...]


def _text_steps(rules: RuleSettings) -> list[tuple[str, TextStep]]:
    """The enabled system-text rules, in ``TEXT_RULES`` order."""
    by_name: dict[str, TextStep] = {}

    a = rules.attribution_line
    if a.enabled:
        pattern = attribution.compile_headers(a.headers)

        def _attribution(text: str) -> tuple[str, int, tuple[str, ...]]:
            out, n = attribution.strip_attribution(text, pattern, a.headers)
            return out, n, ()

        by_name[attribution.NAME] = _attribution

    d = rules.volatile_date
    if d.enabled and d.patterns:
        patterns = vdate.compile_patterns([(p.regex, p.hints) for p in d.patterns])
        if d.mode == "day":

            def _date(text: str) -> tuple[str, int, tuple[str, ...]]:
                out, n = vdate.coarsen_dates(text, patterns)
                return out, n, ()
        else:

            def _date(text: str) -> tuple[str, int, tuple[str, ...]]:
                out, lines = vdate.extract_date_lines(text, patterns)
                return out, len(lines), lines

        by_name[vdate.NAME] = _date

    e = rules.env_block
    if e.enabled and e.blocks:

        def _env(text: str) -> tuple[str, int, tuple[str, ...]]:
            out, blocks = env_block.extract_env_blocks(text, e.blocks)
            return out, len(blocks), blocks

        by_name[env_block.NAME] = _env

    w = rules.whitespace
    if w.enabled:

        def _ws(text: str) -> tuple[str, int, tuple[str, ...]]:
            out, n = ws.normalize_whitespace(text, final_newline=w.final_newline, nfc=w.nfc)
            return out, n, ()

        by_name[ws.NAME] = _ws

    return [(name, by_name[name]) for name in TEXT_RULES if name in by_name]


class _RuleSet:
    """One resolved rule configuration with its compiled steps and caches."""

    def __init__(self, rules: RuleSettings, cache_entries: int) -> None:
        self.rules = rules
        self.cache_entries = cache_entries
        self.text_steps = _text_steps(rules)
        self.move_dates = rules.volatile_date.enabled and rules.volatile_date.mode == "move"
        self.tool_rules_on = (
            rules.schema_key_order.enabled or rules.dedupe_tools.enabled or rules.tool_order.enabled
        )
        self._texts: LRU[str, TextOutcome] = LRU(cache_entries)
        self._tools: LRU[bytes, _ToolsOutcome] = LRU(cache_entries)
        self._day_variant: _RuleSet | None = None

    def day_variant(self) -> _RuleSet:
        """The same rules with ``volatile_date`` in ``day`` mode: for requests with no user message."""
        if self._day_variant is None:
            vd = self.rules.volatile_date.model_copy(update={"mode": "day"})
            self._day_variant = _RuleSet(
                self.rules.model_copy(update={"volatile_date": vd}), self.cache_entries
            )
        return self._day_variant

    def canon_text(self, text: str) -> TextOutcome:
        """The canonical form of one system text (cached by the text)."""
        hit = self._texts.get(text)
        if hit is not None:
            return hit
        totals: dict[str, int] = {}
        moved: list[str] = []
        env: list[str] = []
        out = text
        # Run the steps to a fixpoint: what one rule cuts out can bring two lines together that another
        # rule recognises; a second round makes canon(canon(x)) == canon(x) hold for such texts too.
        for _ in range(_MAX_ROUNDS):
            before = out
            for name, step in self.text_steps:
                out, n, taken = step(out)
                if n:
                    totals[name] = totals.get(name, 0) + n
                if taken:
                    (moved if name == vdate.NAME else env).extend(taken)
            if out == before:
                break
        outcome = TextOutcome(out, tuple(totals.items()), tuple(moved), tuple(env))
        self._texts.put(text, outcome)
        return outcome

    def canon_tools(self, tools: list[Any], digest: bytes) -> _ToolsOutcome:
        """Rules 2 and 3 over ``tools`` (cached by ``digest``, the hash of their raw serialization)."""
        hit = self._tools.get(digest)
        if hit is not None:
            return hit
        rules = self.rules
        canon = [schema_keys.canonical_tool(t) for t in tools]
        keys = [orjson.dumps(c) for c in canon]
        names: list[str | None] = [_function_name(t) for t in tools]
        counts: list[tuple[str, int]] = []
        out: list[Any] = list(tools)
        if rules.schema_key_order.enabled:
            n = sum(1 for key, raw in zip(keys, tools, strict=True) if key != orjson.dumps(raw))
            if n:
                counts.append((schema_keys.NAME, n))
                out = canon
        if rules.dedupe_tools.enabled:
            keep, dropped = dedupe_tools.drop_duplicate_tools(
                out, keys, names, rules.dedupe_tools.on_name_conflict
            )
            if dropped:
                counts.append((dedupe_tools.NAME, dropped))
                out = [out[i] for i in keep]
                names = [names[i] for i in keep]
        named = tuple(n for n in names if n is not None)
        outcome = _ToolsOutcome(tuple(out), named if len(named) == len(names) else None, tuple(counts))
        self._tools.put(digest, outcome)
        return outcome


def _function_name(tool: Any) -> str | None:
    if isinstance(tool, dict):
        fn = tool.get("function")
        if isinstance(fn, dict):
            name = fn.get("name")
            if isinstance(name, str):
                return name
    return None


def _add(rewrites: dict[str, int], counts: Sequence[tuple[str, int]]) -> None:
    for name, n in counts:
        rewrites[name] = rewrites.get(name, 0) + n


def is_system_message(message: Any) -> bool:
    """Whether ``message`` is a system (or developer) message."""
    return isinstance(message, dict) and isinstance(role := message.get("role"), str) and role in SYSTEM_ROLES


def _is_user(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and message.get("role") == "user"
        and isinstance(message.get("content"), (str, list))
    )


def _attach_lines(message: dict[str, Any], lines: list[str]) -> dict[str, Any] | None:
    """``message`` with ``lines`` appended to its content, or None when they already are (idempotence)."""
    content = message.get("content")
    if isinstance(content, str):
        suffix = "".join("\n\n" + line for line in lines)
        if content.endswith(suffix) or content == suffix[2:]:
            return None
        return {**message, "content": content + suffix}
    if isinstance(content, list):
        tail = content[-len(lines) :]
        if len(tail) == len(lines) and all(
            isinstance(p, dict) and p.get("type") == "text" and p.get("text") == line
            for p, line in zip(tail, lines, strict=True)
        ):
            return None
        return {**message, "content": [*content, *({"type": "text", "text": line} for line in lines)]}
    return None


class Canonicalizer:
    """Applies the configured rules to request bodies. One instance per process; cheap to call."""

    _MAX_RESOLVED = 4096

    def __init__(self, config: CanonicalConfig | None = None, *, strict: bool = False) -> None:
        """``strict`` re-raises internal errors instead of passing the body through (for tests)."""
        self.config = config if config is not None else CanonicalConfig()
        self._strict = strict
        self._by_settings: dict[RuleSettings, _RuleSet] = {}
        self._resolved: dict[tuple[str | None, str | None], _RuleSet | None] = {}

    def _ruleset(self, model: str | None, client_label: str | None) -> _RuleSet | None:
        key = (model, client_label)
        if key in self._resolved:
            return self._resolved[key]
        enabled, rules = self.config.resolve(model, client_label)
        ruleset: _RuleSet | None = None
        if enabled:
            ruleset = self._by_settings.get(rules)
            if ruleset is None:
                ruleset = self._by_settings[rules] = _RuleSet(rules, self.config.cache_entries)
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
        ``session`` carries first-seen tool order and moved-date attachments across turns.
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
            if isinstance(messages, list) and (ruleset.text_steps or ruleset.move_dates):
                new_messages = self._canon_messages(messages, ruleset, session, rewrites)
            tools = body.get("tools")
            new_tools = None
            if isinstance(tools, list) and tools and ruleset.tool_rules_on:
                new_tools = self._canon_tools(tools, ruleset, session, rewrites)
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

    def _canon_messages(
        self,
        messages: list[Any],
        ruleset: _RuleSet,
        session: SessionCanonState | None,
        rewrites: dict[str, int],
    ) -> list[Any] | None:
        k = 0
        while k < len(messages) and is_system_message(messages[k]):
            k += 1
        rest = messages[k:]
        counts: dict[str, int] = {}
        system, sys_changed, moved, env = self._canon_system(messages[:k], ruleset, counts)
        if moved and not any(_is_user(m) for m in rest):
            if not env:
                # Nowhere to move the date to: coarsen it in place instead.
                return self._canon_messages(messages, ruleset.day_variant(), session, rewrites)
            env.append("\n".join(moved))  # the only user-side message is the environment one
            moved = []
        _add(rewrites, counts.items())

        base = len(system) + (1 if env else 0)
        edited_rest: dict[int, dict[str, Any]] = {}
        if ruleset.move_dates:
            edited_rest = self._attach_dates(rest, base, moved, ruleset, session)
            if edited_rest:
                rewrites[vdate.NAME] = rewrites.get(vdate.NAME, 0) + len(edited_rest)
        if not sys_changed and not env and not edited_rest:
            return None
        out = system
        if env:
            out.append({"role": "user", "content": "\n\n".join(env)})
        if edited_rest:
            out.extend(edited_rest.get(j, m) for j, m in enumerate(rest))
        else:
            out.extend(rest)
        return out

    @staticmethod
    def _canon_system(
        system: list[dict[str, Any]], ruleset: _RuleSet, counts: dict[str, int]
    ) -> tuple[list[Any], bool, list[str], list[str]]:
        """Canonical leading system messages (emptied ones dropped), whether any changed, what moved."""
        out: list[Any] = []
        changed = False
        moved: list[str] = []
        env: list[str] = []

        def canon(text: str) -> str | None:
            outcome = ruleset.canon_text(text)
            _add(counts, outcome.counts)
            moved.extend(outcome.moved_lines)
            env.extend(outcome.env_blocks)
            if outcome.text == text:
                return text
            # A text emptied by taking things out of it goes away rather than render as an empty turn.
            return None if not outcome.text.strip() and text.strip() else outcome.text

        for msg in system:
            content = msg.get("content")
            if isinstance(content, str):
                new = canon(content)
                if new is content:
                    out.append(msg)
                    continue
                changed = True
                if new is not None:
                    out.append({**msg, "content": new})
            elif isinstance(content, list):
                parts: list[Any] = []
                part_changed = False
                for part in content:
                    text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
                    if not isinstance(text, str):
                        parts.append(part)
                        continue
                    new = canon(text)
                    if new is text:
                        parts.append(part)
                        continue
                    part_changed = True
                    if new is not None:
                        parts.append({**part, "text": new})
                if not part_changed:
                    out.append(msg)
                    continue
                changed = True
                if parts:
                    out.append({**msg, "content": parts})
            else:
                out.append(msg)
        return out, changed, moved, env

    @staticmethod
    def _attach_dates(
        rest: list[Any],
        base: int,
        moved: list[str],
        ruleset: _RuleSet,
        session: SessionCanonState | None,
    ) -> dict[int, dict[str, Any]]:
        """Append moved date lines to user messages; returns the edited messages by index in ``rest``.

        Anchors are indices into the canonical message list (``base`` + index in ``rest``), so a
        second pass over canonical output finds the lines already there.
        """
        anchors = list(session.get_date_anchors() or ()) if session is not None else []
        before = list(anchors)

        def valid(index: int) -> bool:
            return 0 <= index - base < len(rest) and _is_user(rest[index - base])

        if moved:
            line = "\n".join(moved)
            newest = next((j for j in range(len(rest) - 1, -1, -1) if _is_user(rest[j])), None)
            if newest is not None:
                target = base + newest
                if anchors and anchors[-1][1] == line and valid(anchors[-1][0]):
                    pass  # this date is already attached to a message still in the history
                elif anchors and (anchors[-1][0] == target or not valid(anchors[-1][0])):
                    anchors[-1] = (target, line)
                else:
                    anchors.append((target, line))
                del anchors[: -ruleset.rules.volatile_date.max_anchors]
        if session is not None and anchors != before:
            session.set_date_anchors(anchors)

        by_index: dict[int, list[str]] = {}
        for index, line in anchors:
            if valid(index):
                lines = by_index.setdefault(index - base, [])
                if line not in lines:
                    lines.append(line)
        edited: dict[int, dict[str, Any]] = {}
        for j, lines in by_index.items():
            new = _attach_lines(rest[j], lines)
            if new is not None:
                edited[j] = new
        return edited

    @staticmethod
    def _canon_tools(
        tools: list[Any],
        ruleset: _RuleSet,
        session: SessionCanonState | None,
        rewrites: dict[str, int],
    ) -> list[Any] | None:
        try:
            digest = xxhash.xxh3_128_digest(orjson.dumps(tools))
        except (TypeError, orjson.JSONEncodeError):
            return None  # not JSON-serializable as given (e.g. an integer over 64 bits): leave alone
        outcome = ruleset.canon_tools(tools, digest)
        _add(rewrites, outcome.counts)
        canon = outcome.tools
        order = ruleset.rules.tool_order
        positions: list[int] | None = None
        if order.enabled and outcome.names is not None and len(outcome.names) > 1:
            mode = order.mode if order.mode == "sort" or session is not None else order.sessionless
            if mode == "sort":
                positions = tool_order.sorted_positions(outcome.names)
            elif mode == "session" and session is not None:
                positions, stored = tool_order.session_positions(
                    outcome.names, session.get_tool_order(), order.max_names
                )
                if stored is not None:
                    session.set_tool_order(stored)
            if positions is not None:
                moved = sum(1 for i, p in enumerate(positions) if i != p)
                if moved:
                    rewrites[tool_order.NAME] = rewrites.get(tool_order.NAME, 0) + moved
                else:
                    positions = None
        if positions is None:
            if not outcome.counts:
                return None
            return list(canon)
        return [canon[p] for p in positions]
