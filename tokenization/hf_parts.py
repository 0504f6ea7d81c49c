"""Which tokens of a rendered chat prompt belong to which message, resumed from the previous turn.

A chat template's output cannot be split per message in general, so a message is located by its
content's first occurrence after the previous message's, and its part starts at the last added token
(its turn header, e.g. ``<|im_start|>``) before that. Messages whose content cannot be located join
the part before them; tokens before the first located message are the ``prelude``.

That walk searches the whole rendered text: ~1.1 ms a turn on a 100k-token conversation, a quarter
of what the turn cost. So each turn keeps its walk (``Walk``), and the next turn, whose text equals
this one's up to where it re-encodes, takes over the messages that lie wholly before that point and
searches only after them. The result is the walk from scratch, exactly (the argument is at
``resumable``); the tests compare the two on random conversations.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenization.base import Part

#: ``Walk.found`` of a message whose content is not a non-empty string: located in no text.
NOT_TEXT = -2
#: ``Walk.found`` of a message whose content was not found after the previous message's.
NOT_FOUND = -1


@dataclass(frozen=True, slots=True)
class Walk:
    """One turn's walk over its messages. Per message: where its content was found in the text
    (``found``: a char offset, ``NOT_FOUND`` or ``NOT_TEXT``), where the search went on from after
    it (``searched``), and how many of ``bounds`` it had made; ``bounds``: each part's label and
    first token, the prelude aside."""

    found: array  # "q"
    searched: array  # "q"
    made: array  # "L"
    bounds: tuple[tuple[str, int], ...]

    @property
    def nbytes(self) -> int:
        return 24 * len(self.found) + 80 * len(self.bounds)


def message_parts(
    text: str,
    messages: Sequence[Mapping[str, Any]],
    starts: array,
    anchors: array,
    num_tokens: int,
    previous: Walk | None = None,
    unchanged: int = 0,
) -> tuple[tuple[Part, ...], Walk]:
    """Approximate token spans per message of ``text`` (``starts``: each token's first char;
    ``anchors``: indices of the added tokens, ascending), and the walk that found them.

    ``previous``: the previous turn's walk, whose text and tokens equal these up to char
    ``unchanged`` (where this turn's re-encoding began: no token before it changed)."""
    found, searched, made = array("q"), array("q"), array("L")
    bounds: list[tuple[str, int]] = []
    pos = 0
    first = resumable(previous, messages, text, unchanged) if previous is not None else 0
    if previous is not None and first:
        found, searched, made = previous.found[:first], previous.searched[:first], previous.made[:first]
        bounds = list(previous.bounds[: made[-1]])
        pos = searched[-1]
    for i in range(first, len(messages)):
        content = messages[i].get("content")
        at = NOT_TEXT
        if isinstance(content, str) and content:
            at = text.find(content, pos)
            if at >= 0:
                pos = at + len(content)
                token = bisect_right(starts, at) - 1
                k = bisect_right(anchors, token) - 1
                last = bounds[-1][1] if bounds else 0
                if k >= 0 and anchors[k] >= last:
                    token = anchors[k]
                if not bounds or token > last:
                    bounds.append((f"message[{i}]", token))
        found.append(at)
        searched.append(pos)
        made.append(len(bounds))
    walk = Walk(found, searched, made, tuple(bounds))
    if not bounds or bounds[0][1] > 0:
        bounds.insert(0, ("prelude", 0))
    ends = [b[1] for b in bounds[1:]] + [num_tokens]
    parts = tuple((label, start, end) for (label, start), end in zip(bounds, ends, strict=True))
    return parts, walk


def resumable(previous: Walk, messages: Sequence[Mapping[str, Any]], text: str, unchanged: int) -> int:
    """How many leading messages keep ``previous``'s outcome: each one's content is still not text,
    or is the same text found at the same place, ending by char ``unchanged``.

    Such a message's search gives what it gave before: it starts where the previous turn's did (the
    messages before it kept theirs), and any occurrence of its content starting earlier would end
    before ``unchanged``, where the texts are equal, so the previous search would have found it.
    Its token and the anchor before it lie before ``unchanged`` too, where the tokens are equal. A
    message whose content was not found stops the resumption: this turn's text may hold it."""
    n = 0
    limit = min(len(previous.found), len(messages))
    found, searched = previous.found, previous.searched
    while n < limit:
        content = messages[n].get("content")
        at = found[n]
        if at == NOT_TEXT:
            if isinstance(content, str) and content:
                break
        elif (
            at == NOT_FOUND
            or searched[n] > unchanged
            or not isinstance(content, str)
            or len(content) != searched[n] - at
            or not text.startswith(content, at)
        ):
            break
        n += 1
    return n
