"""The message side of the engine: the leading system messages through the text steps, and where the
text they take out goes.

Only the leading system (or developer) messages are rewritten, plus the one user message inserted
after them (``Destination.AFTER_SYSTEM``) and the user messages that pinned text is attached to
(``Destination.NEWEST_USER``); every other message is passed on as the same object, so the cost does
not grow with the conversation. The canonical form of a system text is cached by the text itself.

Pinned text: the session remembers ``(message index, text)`` anchors (``SessionCanonState`` date
anchors), indices into the canonical message list. The text goes to the newest user message when it
first appears or changes, and every later turn re-attaches each anchor to its message, so the history
stays byte-stable; a request with no user message runs the pinning steps' ``without_user`` fallback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.canonical.rules.base import Destination, Moved, TextStep
from proxy.canonical.state import SessionCanonState
from tokenization.lru import LRU

SYSTEM_ROLES = frozenset({"system", "developer"})
_MAX_ROUNDS = 4


@dataclass(frozen=True, slots=True)
class TextOutcome:
    """The canonical form of one system text: the text, per-rule counts and what was taken out."""

    text: str
    counts: tuple[tuple[str, int], ...]
    moved: tuple[Moved, ...]


def add_counts(rewrites: dict[str, int], counts: Iterable[tuple[str, int]]) -> None:
    """Add per-rule ``counts`` into ``rewrites``."""
    for name, n in counts:
        rewrites[name] = rewrites.get(name, 0) + n


class TextSteps:
    """The enabled text rules of one rule set, compiled, in order, with the cache of their outcomes."""

    def __init__(self, steps: Sequence[tuple[str, TextStep]], cache_entries: int) -> None:
        self.steps = tuple(steps)
        self.cache_entries = cache_entries
        pinning = [(name, step.user_anchors) for name, step in self.steps if step.user_anchors]
        # Attaching pinned text to a user message counts as a rewrite of the first rule that pins.
        self.pin_owner: str | None = pinning[0][0] if pinning else None
        self.pin_joined = next((step.joined for _, step in self.steps if step.user_anchors), False)
        self.max_anchors = max((n for _, n in pinning), default=0)
        self._texts: LRU[str, TextOutcome] = LRU(cache_entries)
        self._without_user: TextSteps | None = None

    def without_user(self) -> TextSteps | None:
        """These steps with each ``without_user`` fallback in place (for a request with no user
        message), or None when no step has one."""
        if not any(step.without_user is not None for _, step in self.steps):
            return None
        if self._without_user is None:
            steps = [(name, step.without_user or step) for name, step in self.steps]
            self._without_user = TextSteps(steps, self.cache_entries)
        return self._without_user

    def canon(self, text: str) -> TextOutcome:
        """The canonical form of one system text (cached by the text)."""
        hit = self._texts.get(text)
        if hit is not None:
            return hit
        totals: dict[str, int] = {}
        moved: list[Moved] = []
        out = text
        # Run the steps to a fixpoint: what one rule cuts out can bring two lines together that another
        # rule recognises; a second round makes canon(canon(x)) == canon(x) hold for such texts too.
        for _ in range(_MAX_ROUNDS):
            before = out
            for name, step in self.steps:
                if step.markers and not any(marker in out for marker in step.markers):
                    continue  # nothing the step could change is in the text (``TextStep.markers``)
                edit = step.run(out)
                out = edit.text
                if edit.count:
                    totals[name] = totals.get(name, 0) + edit.count
                for item in edit.moved:
                    if item.to is Destination.NEWEST_USER and not step.user_anchors:
                        raise ValueError(f"rule {name!r} pins text to a user message without user_anchors")
                    moved.append(item)
            if out == before:
                break
        outcome = TextOutcome(out, tuple(totals.items()), tuple(moved))
        self._texts.put(text, outcome)
        return outcome


def is_system_message(message: Any) -> bool:
    """Whether ``message`` is a system (or developer) message."""
    return isinstance(message, dict) and isinstance(role := message.get("role"), str) and role in SYSTEM_ROLES


def _is_user(message: Any) -> bool:
    return (
        isinstance(message, dict)
        and message.get("role") == "user"
        and isinstance(message.get("content"), (str, list))
    )


def canon_messages(
    messages: list[Any], texts: TextSteps, session: SessionCanonState | None, rewrites: dict[str, int]
) -> list[Any] | None:
    """The canonical message list, or None when nothing changes; adds the rewrites made."""
    k = 0
    while k < len(messages) and is_system_message(messages[k]):
        k += 1
    rest = messages[k:]
    counts: dict[str, int] = {}
    system, sys_changed, to_user, after = _canon_system(messages[:k], texts, counts)
    if to_user and not any(_is_user(m) for m in rest):
        fallback = texts.without_user()
        if not after and fallback is not None:
            # Nowhere to pin the text to: the fallback (volatile_date: coarsen in place) instead.
            return canon_messages(messages, fallback, session, rewrites)
        after.append("\n".join(to_user))  # the only user-side message is the one after the system
        to_user = []
    add_counts(rewrites, counts.items())

    base = len(system) + (1 if after else 0)
    edited_rest: dict[int, dict[str, Any]] = {}
    if texts.pin_owner is not None:
        edited_rest = _attach_pinned(rest, base, to_user, texts.max_anchors, session, texts.pin_joined)
        if edited_rest:
            rewrites[texts.pin_owner] = rewrites.get(texts.pin_owner, 0) + len(edited_rest)
    if not sys_changed and not after and not edited_rest:
        return None
    out = system
    if after:
        out.append({"role": "user", "content": "\n\n".join(after)})
    if edited_rest:
        out.extend(edited_rest.get(j, m) for j, m in enumerate(rest))
    else:
        out.extend(rest)
    return out


def _canon_system(
    system: list[dict[str, Any]], texts: TextSteps, counts: dict[str, int]
) -> tuple[list[Any], bool, list[str], list[str]]:
    """Canonical leading system messages (emptied ones dropped), whether any changed, and the text
    taken out: for the newest user message, and for the message after the system messages."""
    out: list[Any] = []
    changed = False
    to_user: list[str] = []
    after: list[str] = []

    def canon(text: str) -> str | None:
        outcome = texts.canon(text)
        add_counts(counts, outcome.counts)
        for item in outcome.moved:
            (to_user if item.to is Destination.NEWEST_USER else after).append(item.text)
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
    return out, changed, to_user, after


def _attach_lines(message: dict[str, Any], lines: list[str], joined: bool = False) -> dict[str, Any] | None:
    """``message`` with ``lines`` appended to its content, or None when they already are (idempotence).
    ``joined``: into the last text part of a list content (see ``TextStep.joined``)."""
    content = message.get("content")
    suffix = "".join("\n\n" + line for line in lines)
    if isinstance(content, str):
        if content.endswith(suffix) or content == suffix[2:]:
            return None
        return {**message, "content": content + suffix}
    if not isinstance(content, list):
        return None
    last = content[-1] if content else None
    if joined and isinstance(last, dict) and last.get("type") == "text" and isinstance(last.get("text"), str):
        text = last["text"]
        if text.endswith(suffix) or text == suffix[2:]:
            return None
        return {**message, "content": [*content[:-1], {**last, "text": text + suffix}]}
    tail = content[-len(lines) :]
    if len(tail) == len(lines) and all(
        isinstance(p, dict) and p.get("type") == "text" and p.get("text") == line
        for p, line in zip(tail, lines, strict=True)
    ):
        return None
    return {**message, "content": [*content, *({"type": "text", "text": line} for line in lines)]}


def _pin_pieces(
    anchors: list[tuple[int, str]], pieces: list[str], target: int, valid: Callable[[int], bool]
) -> None:
    """Pin each piece on its own (``TextStep.joined``): a piece whose latest attachment still in the
    history has the same text stays there; a changed one (known by its first line, a section's
    heading) goes to ``target``, the newest user message, replacing an attachment already there."""
    latest: dict[str, int] = {}
    for i, (index, text) in enumerate(anchors):
        if valid(index):
            latest[text.split("\n", 1)[0]] = i
    for piece in pieces:
        at = latest.get(piece.split("\n", 1)[0])
        if at is not None and anchors[at][1] == piece:
            continue
        if at is not None and anchors[at][0] == target:
            anchors[at] = (target, piece)
        else:
            anchors.append((target, piece))


def _attach_pinned(
    rest: list[Any],
    base: int,
    to_user: list[str],
    max_anchors: int,
    session: SessionCanonState | None,
    joined: bool = False,
) -> dict[int, dict[str, Any]]:
    """Attach pinned text to user messages; returns the edited messages by index in ``rest``.

    Anchors are indices into the canonical message list (``base`` + index in ``rest``), so a second
    pass over canonical output finds the text already there.
    """
    anchors = list(session.get_date_anchors() or ()) if session is not None else []
    before = list(anchors)

    def valid(index: int) -> bool:
        return 0 <= index - base < len(rest) and _is_user(rest[index - base])

    newest = next((j for j in range(len(rest) - 1, -1, -1) if _is_user(rest[j])), None) if to_user else None
    if newest is not None and joined:
        _pin_pieces(anchors, to_user, base + newest, valid)
        del anchors[:-max_anchors]
    elif newest is not None:
        line = "\n".join(to_user)
        target = base + newest
        if anchors and anchors[-1][1] == line and valid(anchors[-1][0]):
            pass  # this text is already attached to a message still in the history
        elif anchors and (anchors[-1][0] == target or not valid(anchors[-1][0])):
            anchors[-1] = (target, line)
        else:
            anchors.append((target, line))
        del anchors[:-max_anchors]
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
        new = _attach_lines(rest[j], lines, joined)
        if new is not None:
            edited[j] = new
    return edited
