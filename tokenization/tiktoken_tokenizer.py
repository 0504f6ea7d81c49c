"""The default tokenizer: cl100k_base + the simulated model's ChatML template, incremental per segment.

Every ChatML segment starts with a special token, and special tokens split tokenization, so a
conversation's ids are the concatenation of its segments' ids. The memo keeps one xxh3-128 key per
segment and the token offset where each segment ends: a new turn re-encodes only the segments from
the first one whose key changed. Keys hash the segment's inputs (each message's JSON bytes, the
system message with the tools), so unchanged segments are not even rendered again.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from tokenization.base import (
    DEFAULT_SHARED_CACHE_BYTES,
    ChatPrompt,
    Encoded,
    Part,
    Plan,
    common_prefix_len,
    whole_prompt,
)
from tokenization.chatml import GENERATION_PROMPT, content_text, is_system, render_message, render_system
from tokenization.encoding import chatml_encoding, encode
from tokenization.lru import LRU

# Rough chars per token of code and prose, only to size the work for the thread/inline decision.
CHARS_PER_TOKEN = 4
# An array object's own size, on top of its items, for the shared cache's budget.
_ARRAY_BYTES = 80


@dataclass(frozen=True, slots=True)
class _SegmentMemo:
    keys: tuple[int, ...]  # xxh3-128 of each segment's inputs
    ends: tuple[int, ...]  # token offset where each segment ends


def segment_labels(
    messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None, generation: bool
) -> list[str]:
    """One label per segment of ``chatml.render_segments``, in order."""
    has_system = bool(messages) and is_system(messages[0])
    has_tools = bool(tools)
    count = int(has_system or has_tools) + len(messages) - int(has_system) + int(generation)
    return [_segment_label(j, count, has_system, has_tools, generation) for j in range(count)]


def _segment_label(j: int, count: int, has_system: bool, has_tools: bool, generation: bool) -> str:
    """The label of segment ``j`` of ``count`` (one label at a time: a turn labels only new segments)."""
    system_segment = has_system or has_tools
    if j == 0 and system_segment:
        return "system+tools" if has_system and has_tools else "system" if has_system else "tools"
    if generation and j == count - 1:
        return "generation_prompt"
    # Segment index -> message index: a system message is in segment 0, a tools-only segment is not.
    return f"message[{j + int(has_system) - int(system_segment)}]"


_GENERATION_KEY = 0  # the generation prompt segment never changes


def _canonical(value: Any) -> bytes:
    """Deterministic bytes of a message or tool list (orjson keeps key order); a cache key only."""
    try:
        return orjson.dumps(value)
    except TypeError:  # e.g. integers beyond 64 bits, which orjson refuses
        return json.dumps(value, ensure_ascii=False, default=repr).encode()


class TiktokenTokenizer:
    """cl100k_base with ``<|im_start|>``/``<|im_end|>`` and ``tokenization.chatml``: offline, exact for
    the simulated ranks, an estimate for other models."""

    kind = "tiktoken"

    def __init__(self, shared_cache_bytes: int = DEFAULT_SHARED_CACHE_BYTES) -> None:
        self._encoding = chatml_encoding()
        self._specials = self._encoding.special_tokens_set
        # tiktoken's private fast path (0.8+, used by its own encode_to_numpy); absent -> lists.
        to_buffer = getattr(self._encoding._core_bpe, "encode_to_tiktoken_buffer", None)
        self._to_buffer = to_buffer if array("I").itemsize == 4 else None
        #: The system+tools segment's token ids by segment key, across sessions
        #: (see ``DEFAULT_SHARED_CACHE_BYTES``).
        self.shared = LRU[int, array](shared_cache_bytes)

    def _encode_into(self, tokens: array, text: str) -> None:
        """Append ``text``'s ids to ``tokens``: through tiktoken's uint32 buffer when it has one, which
        skips building a Python int per token (~6 % of an appended turn's encode)."""
        if self._to_buffer is None:
            tokens.fromlist(encode(text))
        else:
            tokens.frombytes(memoryview(self._to_buffer(text, self._specials)).cast("B"))

    def encode_chat(self, prompt: ChatPrompt, prev: Encoded | None = None) -> Encoded:
        """Synchronous ``plan_chat(...).finish()``."""
        return self._plan_chat(prompt, prev).finish()

    async def plan_chat(self, prompt: ChatPrompt, prev: Encoded | None) -> Plan:
        """Render and diff inline; ``finish`` encodes the changed and new segments."""
        return self._plan_chat(prompt, prev)

    def _plan_chat(self, prompt: ChatPrompt, prev: Encoded | None) -> Plan:
        messages, tools, generation = prompt.messages, prompt.tools, prompt.add_generation_prompt
        has_system = bool(messages) and is_system(messages[0])
        has_tools = bool(tools)
        first_message = 1 if has_system else 0
        system_segment = has_system or has_tools
        # Keys hash each segment's inputs (the message's JSON bytes), not its rendered text: unchanged
        # segments are then never rendered again, only serialized by orjson.
        digest = xxhash.xxh3_128_intdigest
        keys: list[int] = []
        if system_segment:
            keys.append(digest(_canonical([messages[0] if has_system else None, tools])))
        keys.extend(digest(_canonical(m)) for m in messages[first_message:])
        if generation:
            keys.append(_GENERATION_KEY)
        frozen_keys = tuple(keys)
        memo = prev.memo if prev is not None and isinstance(prev.memo, _SegmentMemo) else None
        first = reused = 0
        if memo is not None:
            first = common_prefix_len(memo.keys, frozen_keys)
            reused = memo.ends[first - 1] if first else 0
        offset = first_message - (1 if system_segment else 0)  # segment index -> message index
        # A session's first turn (or a changed system prompt): another session of the same agent
        # may have encoded this system+tools segment already.
        lead: array | None = self.shared.get(keys[0]) if first == 0 and system_segment else None
        encode_from = first if lead is None else 1
        segments: list[str] = []
        for j in range(encode_from, len(keys)):
            if j == 0 and system_segment:
                system_text = content_text(messages[0].get("content")) if has_system else None
                segments.append(render_system(system_text, tools) or "")
            elif generation and j == len(keys) - 1:
                segments.append(GENERATION_PROMPT)
            else:
                segments.append(render_message(messages[j + offset]))
        work = sum(map(len, segments)) // CHARS_PER_TOKEN

        def _label(j: int) -> str:
            return _segment_label(j, len(frozen_keys), has_system, has_tools, generation)

        def finish() -> Encoded:
            tokens = prev.tokens[:reused] if prev is not None and reused else array("I")
            ends = list(memo.ends[:first]) if memo is not None else []
            # Unchanged segments keep their labels: same keys up to ``first`` = same message layout.
            parts: list[Part] = list(prev.parts[:first]) if prev is not None and first else []
            start = reused
            if lead is not None:
                tokens = lead[:]  # a copy: the cached ids are shared
                ends.append(len(lead))
                parts.append((_label(0), 0, len(lead)))
                start = len(lead)
            labels = [_label(j) for j in range(encode_from, len(frozen_keys))]
            for j, (segment, label) in enumerate(zip(segments, labels, strict=True), encode_from):
                self._encode_into(tokens, segment)
                end = len(tokens)
                if j == 0 and system_segment:
                    ids = tokens[start:end]
                    self.shared.put(frozen_keys[0], ids, _ARRAY_BYTES + 4 * len(ids))
                ends.append(end)
                parts.append((label, start, end))
                start = end
            memo_bytes = len(frozen_keys) * 90
            return Encoded(
                tokens,
                tuple(parts),
                reused,
                _SegmentMemo(frozen_keys, tuple(ends)),
                memo_bytes,
                shared_tokens=ends[0] if system_segment else 0,
            )

        return Plan(work, finish)

    async def plan_text(self, text: str, prev: Encoded | None, model: str | None = None) -> Plan:
        """A completion prompt: encoded whole (cl100k adds no BOS); block hashes reuse the common prefix."""
        del model

        def finish() -> Encoded:
            tokens = array("I")
            self._encode_into(tokens, text)
            return whole_prompt(tokens, prev)

        return Plan(len(text) // CHARS_PER_TOKEN, finish)
