"""How many tokens a text is, before it is encoded: characters per token, learned from what was encoded.

A prompt's size is needed before its tokens are: to decide whether encoding it is worth a worker
thread, and to route and admit a long first turn on its head while the rest is encoded beside it
(``tokenization/prompt.py``). A fixed 4 characters per token is wrong both ways on the traffic this
proxy sees (cl100k): agents' system prompts and tool schemas (``../shared/agents``) encode at 4.4-5.0,
tool results full of paths, numbers and hashes at about 2.2, and the benchmarks' generated text at
about 5.9, whose first turns were estimated 1.5x too large. Each tokenizer learns its own ratio
from every text it encodes, weighted by size.

Invariant: ``tokens(chars)`` is ``chars`` divided by a ratio between ``MIN_RATIO`` and ``MAX_RATIO``
characters per token (rounded down), however the learned text was made.
"""

from __future__ import annotations

#: The ratio before anything is learned: about right for English prose.
PRIOR_CHARS_PER_TOKEN = 4.0
#: The prior counts as this many tokens of text: a few short messages do not swing it.
PRIOR_TOKENS = 1024.0
#: A text of this many tokens halves the weight of everything learned before it: the ratio follows
#: the traffic of the last few million tokens, not of the process's whole life.
HALF_LIFE_TOKENS = 2_000_000.0
#: Texts under this many tokens are mostly the chat template's markers: not learned from.
MIN_LEARNED_TOKENS = 32
#: Bounds of the ratio (a text of one repeated character encodes at hundreds per token).
MIN_RATIO = 1.0
MAX_RATIO = 16.0


class TextSize:
    """Characters per token of one tokenizer's past texts (decayed sums of both).

    ``learn`` runs in the tokenizer's worker threads as well as on the event loop. Two updates racing
    may lose one of them: an estimate's input, not state anything is counted by, so no lock.
    """

    def __init__(self) -> None:
        self._chars = PRIOR_CHARS_PER_TOKEN * PRIOR_TOKENS
        self._tokens = PRIOR_TOKENS

    @property
    def chars_per_token(self) -> float:
        return min(MAX_RATIO, max(MIN_RATIO, self._chars / self._tokens))

    def tokens(self, chars: int) -> int:
        """The estimated tokens of a text of ``chars`` characters."""
        return int(chars / self.chars_per_token)

    def learn(self, chars: int, tokens: int) -> None:
        """A text of ``chars`` characters encoded into ``tokens`` tokens."""
        if tokens < MIN_LEARNED_TOKENS:
            return
        keep = 0.5 ** (tokens / HALF_LIFE_TOKENS)
        self._chars = self._chars * keep + chars
        self._tokens = self._tokens * keep + tokens
