"""The rule interface: what a canonicalization rule declares, and one step signature per kind.

A rule is a module of ``proxy/canonical/rules`` that defines ``RULE``, an instance of one of the four
kinds below (the class is the kind), with:

- ``name``: its key in the ``canonical.rules`` configuration section and its label in the rewrite
  metrics;
- ``settings``: its settings model, a ``RuleConfig`` (pydantic, frozen, unknown keys rejected, an
  ``enabled`` switch; every default is the safe one);
- ``build``: settings -> the rule's step, compiled when the canonicalizer is made (the gateway's
  start), once per rule set the configuration can resolve to (regexes and the like), or None when
  these settings leave nothing to do. ``build`` is only called for enabled rules.

The kinds and their steps:

- ``MessagesRule``: ``step(messages) -> MessagesEdit``, over the request's whole message list, before
  every other step (the text steps then see its result). A pure function of the list: it must be
  cheap (it runs on every request) and keep every message it leaves alone as the same object.
- ``TextRule``: ``TextStep.run(text) -> TextEdit``, over each text of the leading system messages,
  cached by the text. What the step takes out of the text and where it goes is declared in
  ``TextEdit.moved`` (``Destination``); the engine carries it there. A step that can only change a
  text holding one of a few literals (an agent's section heading, a header's name) declares them
  (``TextStep.markers``): the engine runs it on such texts only.
- ``ToolsRule``: ``step(ToolList) -> ToolsEdit``, a pure function of the tool list, cached by a
  digest of the raw tools.
- ``SessionToolsRule``: ``step(ToolList, session) -> ToolsEdit``, run on every request after the
  cached tool steps, with the session's ``SessionCanonState`` (None without a session).

Counts are rewrites, reported per rule name; a zero count means the step changed nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, TypeAlias, TypeVar

from pydantic import BaseModel, ConfigDict

from proxy.canonical.state import SessionCanonState


class StrictModel(BaseModel):
    """Frozen, unknown keys rejected: the base of every configuration model here."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class RuleConfig(StrictModel):
    """The base of a rule's settings model; a rule that is opt-in overrides ``enabled = False``."""

    enabled: bool = True


class Destination(Enum):
    """Where text taken out of the system prompt goes."""

    # One user message inserted right after the system messages (after the part every session of an
    # agent shares), texts joined by a blank line.
    AFTER_SYSTEM = "after_system"
    # Appended to the newest user message and pinned there: the session remembers the attachment and
    # re-applies it on every later turn, so the history stays byte-stable. A step that moves text here
    # declares ``TextStep.user_anchors``.
    NEWEST_USER = "newest_user"


@dataclass(frozen=True, slots=True)
class Moved:
    """A piece of text a step took out of a system text, and where it goes."""

    text: str
    to: Destination


@dataclass(frozen=True, slots=True)
class TextEdit:
    """A text step's result: the new text, the rewrite count, what was taken out (in text order)."""

    text: str
    count: int = 0
    moved: tuple[Moved, ...] = ()


@dataclass(frozen=True, slots=True)
class TextStep:
    """A compiled text rule.

    For a step that moves text to ``Destination.NEWEST_USER``: ``user_anchors`` is how many such
    attachments a session remembers (at least 1), and ``without_user`` the step to run instead on a
    request with no user message (None: the text goes to the message after the system messages).
    ``joined``: text attached to a message whose content is a list goes into its last text part
    (after a blank line, as on a string content) rather than into a part of its own, so the message
    renders the same whether a client sends its content as a string or as text parts (Claude Code
    turns one into the other between requests). The first pinning rule's choice applies.

    ``markers``: literals (case-sensitive) of which a text must hold at least one for ``run`` to
    change it; the engine skips the step on a text holding none (a substring test, where the step
    would scan the text with its patterns). Empty: the step runs on every text.
    """

    run: Callable[[str], TextEdit]
    user_anchors: int = 0
    without_user: TextStep | None = None
    joined: bool = False
    markers: tuple[str, ...] = ()


def function_name(tool: Any) -> str | None:
    """The ``function.name`` of an OpenAI tool envelope, or None."""
    if isinstance(tool, dict):
        fn = tool.get("function")
        if isinstance(fn, dict):
            name = fn.get("name")
            if isinstance(name, str):
                return name
    return None


@dataclass(frozen=True, slots=True)
class ToolList:
    """A request's tools as the tool steps see them.

    ``names[i]`` is the function name of ``tools[i]`` (None when it has none). ``keys[i]``, when a step
    has computed it, is the canonical serialization of ``tools[i]`` (``schema_key_order``'s form):
    equal keys, same definition. A step that changes tools passes keys on only when still true.
    """

    tools: tuple[Any, ...]
    names: tuple[str | None, ...]
    keys: tuple[bytes, ...] | None = None

    @classmethod
    def of(cls, tools: Sequence[Any]) -> ToolList:
        """The tool list of a request's ``tools``, as sent."""
        return cls(tuple(tools), tuple(function_name(t) for t in tools))

    def all_named(self) -> tuple[str, ...] | None:
        """The function names when every tool has one, else None."""
        names = self.names
        if None in names:
            return None
        return tuple(n for n in names if n is not None)

    def select(self, positions: Sequence[int]) -> ToolList:
        """The tools at ``positions``, in that order (a subset, or a permutation)."""
        keys = self.keys
        return ToolList(
            tuple(self.tools[p] for p in positions),
            tuple(self.names[p] for p in positions),
            None if keys is None else tuple(keys[p] for p in positions),
        )


@dataclass(frozen=True, slots=True)
class ToolsEdit:
    """A tool step's result: the tools to pass on and the rewrite count (0: the same tools)."""

    tools: ToolList
    count: int = 0


@dataclass(frozen=True, slots=True)
class MessagesEdit:
    """A message step's result: the new message list (None: unchanged) and the rewrite count."""

    messages: list[Any] | None
    count: int = 0


MessagesStep: TypeAlias = Callable[[list[Any]], MessagesEdit]
ToolsStep: TypeAlias = Callable[[ToolList], ToolsEdit]
SessionToolsStep: TypeAlias = Callable[[ToolList, SessionCanonState | None], ToolsEdit]

S = TypeVar("S", bound=RuleConfig)


@dataclass(frozen=True, slots=True)
class MessagesRule(Generic[S]):
    """A rule over the request's message list as a whole (which messages there are, their roles)."""

    name: str
    settings: type[S]
    build: Callable[[S], MessagesStep | None]


@dataclass(frozen=True, slots=True)
class TextRule(Generic[S]):
    """A rule over the texts of the leading system messages."""

    name: str
    settings: type[S]
    build: Callable[[S], TextStep | None]


@dataclass(frozen=True, slots=True)
class ToolsRule(Generic[S]):
    """A rule over the tool list that depends on nothing else (its outcome is cached)."""

    name: str
    settings: type[S]
    build: Callable[[S], ToolsStep | None]


@dataclass(frozen=True, slots=True)
class SessionToolsRule(Generic[S]):
    """A rule over the tool list that reads or writes the session's state (runs on every request)."""

    name: str
    settings: type[S]
    build: Callable[[S], SessionToolsStep | None]


Rule: TypeAlias = MessagesRule[Any] | TextRule[Any] | ToolsRule[Any] | SessionToolsRule[Any]
