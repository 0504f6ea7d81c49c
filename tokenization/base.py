"""The ``Tokenizer`` interface: request -> the rank's token ids, incrementally against a previous turn.

A tokenizer works in two steps so that the caller can decide where the CPU work runs: ``plan_*``
does the cheap part inline (render, diff against the previous turn) and returns a ``Plan`` whose
``work`` estimates the tokens still to encode (at the characters per token the tokenizer learned:
``TextSize``); ``Plan.finish()`` does the rest and may run in a worker thread. ``Encoded`` values
are immutable once built, so a finished plan can be shared by concurrent requests without locks.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

#: Budget of each cross-session cache of the leading segment many sessions share (one agent's system
#: prompt + tools): the tokenizer's (segment input -> its token ids) and the incremental tokenizer's
#: (leading tokens + salt -> their full blocks' hashes, which chain from NONE_HASH and are therefore
#: identical for every session with the same salt and hash algorithm). Without them a new session's
#: first turn re-renders, re-tokenizes and re-hashes ~2k tokens another session did a moment ago.
DEFAULT_SHARED_CACHE_BYTES = 32 * 1024 * 1024

_DICT = frozenset({dict})

#: A labelled token span of the prompt: ("system", 0, 812), ("message[3]", 812, 990), ...
Part = tuple[str, int, int]


class UnsupportedRequest(ValueError):
    """The request cannot be tokenized here (malformed or a shape this tokenizer does not handle)."""


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """The parts of an OpenAI chat request that reach the chat template."""

    messages: Sequence[Mapping[str, Any]]
    tools: Sequence[Any] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Mapping[str, Any] | None = None
    model: str | None = None

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ChatPrompt:
        """Validate the shape of an OpenAI chat completion body (already parsed JSON)."""
        messages = body.get("messages")
        # Parsed JSON holds dicts: one C-level pass over the types; the per-message isinstance
        # (an ABC check for anything else) only when something else is there.
        if not isinstance(messages, list) or (
            not set(map(type, messages)) <= _DICT and not all(isinstance(m, Mapping) for m in messages)
        ):
            raise UnsupportedRequest("'messages' must be a list of objects")
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise UnsupportedRequest("'tools' must be a list")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise UnsupportedRequest("'chat_template_kwargs' must be an object")
        model = body.get("model")
        return cls(
            messages=messages,
            tools=tools or None,
            add_generation_prompt=bool(body.get("add_generation_prompt", True)),
            chat_template_kwargs=kwargs,
            model=model if isinstance(model, str) else None,
        )


@dataclass(frozen=True, slots=True)
class Encoded:
    """A prompt's token ids, plus what the tokenizer keeps to encode the next turn incrementally.

    ``reused`` counts the leading tokens known equal to the previous ``Encoded``'s tokens (the one
    passed to ``plan_*``); block hashes of those tokens can be reused. ``shared_tokens`` counts the
    leading tokens of a segment many sessions likely share (system prompt + tools), whose block
    hashes a cross-session cache may hold. ``tokens`` must not be mutated.
    """

    tokens: array  # typecode "I"
    parts: tuple[Part, ...]
    reused: int = 0
    memo: Any = None
    memo_bytes: int = 0
    shared_tokens: int = 0

    @property
    def nbytes(self) -> int:
        """Approximate memory held, for the session cache's budget."""
        return 64 + len(self.tokens) * 4 + len(self.parts) * 120 + self.memo_bytes


@dataclass(frozen=True, slots=True)
class Head:
    """A first turn's head (the leading segment sessions of one agent share, ``Encoded.shared_tokens``)
    as a tokenizer can encode it apart from the rest: what routing a new session needs."""

    #: Names the head's input (the same for every session of the agent): concurrent first turns
    #: encode it once.
    key: Hashable
    #: Estimated tokens ``encode`` still has to encode (0: the tokenizer's cache holds them).
    work: int
    #: The head's token ids (cached by the tokenizer, so that ``finish`` need not encode them again).
    encode: Callable[[], array]


@dataclass(frozen=True, slots=True)
class Plan:
    """Pending tokenization: ``work`` estimated tokens left, ``finish()`` does them. ``head``: the
    prompt's head, when the tokenizer can give it without finishing (a session's first turn).
    ``kept``: leading tokens of the previous turn that ``finish()`` keeps as they are, known before
    it runs (at most its ``Encoded.reused``): what a returning turn can be routed on meanwhile."""

    work: int
    finish: Callable[[], Encoded]
    head: Head | None = None
    kept: int = 0

    @classmethod
    def ready(cls, encoded: Encoded) -> Plan:
        return cls(0, lambda: encoded)


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
    """Characters per token of one tokenizer's past texts (decayed sums of both): how many tokens a
    text is, before it is encoded (``Plan.work``, ``Head.work``).

    A prompt's size is needed before its tokens are: to decide whether encoding it is worth a
    worker thread, and to route and admit a long first turn on its head while the rest is encoded
    beside it (``tokenization/prompt.py``). A fixed 4 characters per token is wrong both ways on the
    traffic this proxy sees (cl100k): agents' system prompts and tool schemas (``../shared/agents``)
    encode at 4.4-5.0, tool results full of paths, numbers and hashes at about 2.2, and the
    benchmarks' generated text at about 5.9, whose first turns were estimated 1.5x too large. Each
    tokenizer learns its own ratio from every text it encodes, weighted by size.

    Invariant: ``tokens(chars)`` is ``chars`` divided by a ratio between ``MIN_RATIO`` and
    ``MAX_RATIO`` characters per token (rounded down), however the learned text was made.

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


class Tokenizer(Protocol):
    """Turns requests into the token ids a rank will see."""

    kind: str

    async def plan_chat(self, prompt: ChatPrompt, prev: Encoded | None) -> Plan:
        """Tokenize a chat request (template applied, no extra BOS: vLLM's chat default)."""
        ...

    async def plan_text(self, text: str, prev: Encoded | None, model: str | None) -> Plan:
        """Tokenize a completion prompt (special tokens added as vLLM's completions do)."""
        ...

    def prepare_thread(self) -> None:
        """Set up what the tokenizer keeps per thread, on the calling thread (nothing, for most)."""
        ...


def common_prefix_len(a: Sequence[Any], b: Sequence[Any], chunk: int = 4096, *, start: int = 0) -> int:
    """Length of the common prefix of two sequences (str, array, list): chunked C compares first.

    ``start``: a length already known common (``a[:start] == b[:start]``); comparing begins there,
    so a caller that extended a shared prefix needs no tail slices."""
    if type(a) is not type(b):  # slices of different types never compare equal: align them
        try:
            if isinstance(a, array):
                b = array(a.typecode, b)
            elif isinstance(a, list):
                b = list(b)
            elif isinstance(a, tuple):
                b = tuple(b)
            else:  # e.g. a str against a list of characters: compare element by element
                a, b = list(a), list(b)
        except (OverflowError, TypeError, ValueError):
            a, b = list(a), list(b)
    n = min(len(a), len(b))
    i = min(start, n)
    # Both slices end at the same index, so a shorter sequence's tail still compares in C.
    while i < n and a[i : min(i + chunk, n)] == b[i : min(i + chunk, n)]:
        i += chunk
    if i >= n:
        return n
    end = min(i + chunk, n)
    while end - i > 64:  # bisect the differing chunk in C-level compares
        mid = (i + end) // 2
        if a[i:mid] == b[i:mid]:
            i = mid
        else:
            end = mid
    while i < end and a[i] == b[i]:
        i += 1
    return i


def whole_prompt(tokens: array, prev: Encoded | None) -> Encoded:
    """A prompt encoded whole (one ``prompt`` part, no memo): reuse is the common prefix with ``prev``."""
    reused = 0 if prev is None else common_prefix_len(prev.tokens, tokens)
    return Encoded(tokens, (("prompt", 0, len(tokens)),), reused)


def token_ids_plan(ids: Sequence[int], prev: Encoded | None) -> Plan:
    """A plan for a prompt given as token ids: nothing to encode, reuse the common prefix."""
    tokens = ids if isinstance(ids, array) and ids.typecode == "I" else array("I", ids)
    return Plan.ready(whole_prompt(tokens, prev))
