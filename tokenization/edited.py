"""How much of an edited segment's encoding its previous version already holds.

An agent often re-sends a message it changed near its end (a reminder dropped from the last user
message, a tool result cut short): the segment's text shares a long prefix with the previous turn's.
Encoding it again from its start repeats work its previous ids already hold; ``kept_lead`` finds a
cut in the common prefix where the ids before it are the previous ids' first ones, so only the text
from the cut on is encoded.

Why a cut is safe: cl100k's pre-tokenizer splits text into pieces (BPE merges never cross a piece),
and two kinds of position always start one. (a) After a newline, at a letter: no piece holds a
newline followed by a letter (letters join only a lead character that is not a newline; runs of
newlines or other whitespace end before a letter). (b) After a letter, at a space, newline, digit
or punctuation mark: a piece holding a letter is a run of letters (with one lead character before
it) or a contraction, which both end at the first character that is not a letter. Deciding the
pieces before such a position looks at no character past the position itself (each alternative
stops at the first character that ends its run; a contraction is at most three characters ending
in letters), and no special token holds either pair of characters (their letters are followed by
``_`` or ``|``, which (b) does not cut at), so none straddles it. Hence the ids of ``text[:c]``
depend on ``text[:c + 1]`` alone, and with ``c`` inside the common prefix they are the previous
ids' first ones. Only ASCII characters are classified, so no Unicode table can disagree with the
tokenizer's. The count of those ids is found from the end, by the byte lengths of the previous ids
past the cut; a count that does not land on the cut exactly refuses the splice
(``tests/tokenization/test_edited.py`` checks splices against whole encodes).
"""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from tokenization.base import common_prefix_len

if TYPE_CHECKING:
    import tiktoken  # for types only: importing this module loads no tokenizer

#: Unchanged leading characters an edited segment needs before its previous ids are reused. A floor,
#: not tuned: a turn whose 2,100-character message was edited at its end took 63 us with the splice
#: against 154 us without, so what a lower floor could save is under ~0.1 ms a turn.
MIN_KEPT_CHARS = 2048
#: Characters searched, from the end of the common prefix back, for a cut.
MAX_CUT_SEARCH = 512
_LETTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
#: Characters a cut may fall on after a letter: never ``_`` or ``|``, which special tokens hold.
_AFTER_LETTER = frozenset(" \t\r\n.,;:!?()[]{}'\"`/=+-*#0123456789")


def kept_lead(
    encoding: tiktoken.Encoding,
    old_ids: array,
    start: int,
    end: int,
    old_text: str,
    text: str,
    min_kept: int = MIN_KEPT_CHARS,
) -> tuple[int, int]:
    """``(ids, characters)``: ``text`` starts with ``characters`` characters whose encoding is the
    first ``ids`` of ``old_ids[start:end]`` (``old_text``'s encoding); ``(0, 0)`` when no cut keeps
    ``min_kept`` characters or more than the previous version has after it."""
    common = common_prefix_len(text, old_text)
    if common < min_kept:
        return 0, 0
    cut = last_fresh_start(text, common)
    if cut < min_kept or cut == 0 or len(old_text) - cut > cut:  # the rest outweighs what is kept
        return 0, 0
    rest = len(old_text[cut:].encode())
    ids = end
    seen = 0
    decode = encoding.decode_single_token_bytes
    while seen < rest and ids > start:
        ids -= 1
        seen += len(decode(old_ids[ids]))
    if seen != rest:  # not on an id boundary: never splice on a guess
        return 0, 0
    return ids - start, cut


def last_fresh_start(text: str, common: int) -> int:
    """The last position before ``common`` where tokenization starts afresh (0: none found within
    ``MAX_CUT_SEARCH`` characters)."""
    # The cut's own character must be in the common prefix: ``c`` stops at ``common - 1``.
    for c in range(common - 1, max(0, common - 1 - MAX_CUT_SEARCH), -1):
        if fresh_start(text, c):
            return c
    return 0


def fresh_start(text: str, c: int) -> bool:
    """Whether a piece starts at ``text[c]`` (``0 < c < len(text)``) whatever follows it: after a
    newline at an ASCII letter, or after an ASCII letter at a space, newline, digit or punctuation
    mark (the module docstring says why)."""
    before, at = text[c - 1], text[c]
    if before in _LETTERS:
        return at in _AFTER_LETTER
    return before == "\n" and at in _LETTERS
