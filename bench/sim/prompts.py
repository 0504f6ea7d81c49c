"""Prompt token ids and block hashes, incremental across the turns of a conversation.

A follow-up turn repeats its whole history: re-encoding 100k tokens and re-hashing 6,000 blocks per
request would make the simulator the bottleneck. Two caches avoid it:
- segment token ids, keyed by the segment text (special tokens split tokenization, so a prompt's ids
  are the concatenation of its segments' ids);
- block-hash chains, keyed by a digest of the first k segments (and the cache salt): a new turn
  finds the longest known segment prefix and hashes only the blocks after it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenization.block_hash import BlockHash, BlockHasher
from tokenization.lru import LRU
from tokenization.tiktoken_tokenizer import IM_START, encode, render_segments


@dataclass(slots=True)
class Prompt:
    """A tokenized prompt and the hashes of its full blocks (shared: copy before mutating)."""

    token_ids: list[int]
    block_hashes: list[BlockHash]


@dataclass(slots=True)
class _Chain:
    num_tokens: int
    hashes: list[BlockHash]  # may be longer than num_tokens // block_size: read only the prefix


def split_segments(text: str) -> list[str]:
    """Split a prompt string before each ``<|im_start|>``: encoding the pieces equals encoding the whole."""
    pieces = text.split(IM_START)
    out = [pieces[0]] if pieces[0] else []
    out.extend(IM_START + p for p in pieces[1:])
    return out


class PromptProcessor:
    """Tokenizes and hashes prompts for one rank configuration, reusing earlier turns' work."""

    def __init__(
        self, hasher: BlockHasher, segment_cache_size: int = 16_384, chain_cache_size: int = 1024
    ) -> None:
        self.hasher = hasher
        # Bounded by entry count: each entry costs 1 of the budget.
        self._segments: LRU[str, list[int]] = LRU(segment_cache_size)
        self._chains: LRU[bytes, _Chain] = LRU(chain_cache_size)
        #: Counters for tests and the benchmark: blocks hashed and segments encoded.
        self.blocks_hashed = 0
        self.segments_encoded = 0

    def segment_ids(self, segment: str) -> list[int]:
        """Token ids of one segment (cached; do not mutate the result)."""
        ids = self._segments.get(segment)
        if ids is None:
            ids = encode(segment)
            self.segments_encoded += 1
            self._segments.put(segment, ids)
        return ids

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Any] | None = None,
        add_generation_prompt: bool = True,
        cache_salt: str | None = None,
    ) -> Prompt:
        """The prompt of a chat request, rendered with the simulated model's template."""
        return self.segments(render_segments(messages, tools, add_generation_prompt), cache_salt)

    def text(self, prompt: str, cache_salt: str | None = None) -> Prompt:
        """The prompt of a completions request given as a string."""
        return self.segments(split_segments(prompt), cache_salt)

    def token_ids(self, token_ids: Sequence[int], cache_salt: str | None = None) -> Prompt:
        """The prompt of a completions request given as token ids (no reuse: hashed in full)."""
        tokens = list(token_ids)
        hashes = self.hasher.hash_blocks(tokens, cache_salt=cache_salt)
        self.blocks_hashed += len(hashes)
        return Prompt(tokens, hashes)

    def segments(self, segments: Sequence[str], cache_salt: str | None = None) -> Prompt:
        """Tokens and block hashes of the concatenated ``segments``."""
        digest = hashlib.blake2b(digest_size=16)
        digest.update(b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode() + b"\x00")
        prefix_keys: list[bytes] = []
        for seg in segments:
            digest.update(seg.encode("utf-8", "surrogatepass"))
            digest.update(b"\x1e")  # separator: ("ab","c") and ("a","bc") must differ
            prefix_keys.append(digest.digest())

        tokens: list[int] = []
        chain: _Chain | None = None
        for k in range(len(prefix_keys), 0, -1):
            chain = self._chains.get(prefix_keys[k - 1])
            if chain is not None:
                break
        boundaries: list[int] = []
        for seg in segments:
            tokens.extend(self.segment_ids(seg))
            boundaries.append(len(tokens))

        size = self.hasher.block_size
        if chain is not None:
            known = chain.num_tokens // size
            hashes = chain.hashes[:known]
        else:
            known = 0
            hashes = []
        if len(tokens) // size > known:
            parent = hashes[-1] if known else None
            new = self.hasher.hash_blocks(tokens, start_block=known, parent=parent, cache_salt=cache_salt)
            self.blocks_hashed += len(new)
            hashes.extend(new)

        # Remember the whole prompt and the prompt minus its last segment (the generation prompt):
        # the next turn of this conversation starts with the latter.
        if prefix_keys:
            self._chains.put(prefix_keys[-1], _Chain(len(tokens), hashes))
        if len(prefix_keys) > 1:
            self._chains.put(prefix_keys[-2], _Chain(boundaries[-2], hashes))
        return Prompt(tokens, hashes)
