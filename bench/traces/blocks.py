"""Trace block ids and their text: each id maps to a fixed chunk of exactly one block of cl100k tokens."""

from __future__ import annotations

import random
from collections.abc import Iterable

import xxhash

#: ``(namespace, id)``: ids are only unique within their namespace.
BlockKey = tuple[str, int]

# Every word is one cl100k token with its leading space, so a chunk of N words is exactly N tokens
# and chunks concatenate without merging across their boundary.
_WORDS = str.split(
    "the of and to in is that for it as with was on be by this are from or at an have not but which all "
    "can one has were more their will if about other into time only some would new also these two any "
    "may first after use been over when such like most very between code file data test value error "
    "system type function return class import model cache block token request session prefix router "
    "rank pool config retry stream chunk header parse render hash route forward update list string "
    "float true false async await path line diff patch assert result output input context window agent "
    "tool call argument schema property name object array index buffer self none module package build "
    "check run start stop read write open close send receive load save find match print log debug warn "
    "info user server client query table column row key map set get put post delete create remove add "
    "change fix bug issue review merge branch commit push pull"
)
VOCABULARY: tuple[str, ...] = tuple(" " + w for w in _WORDS)


class BlockText:
    """Deterministic text for block ids: ``text(key)`` is exactly ``block_tokens`` cl100k tokens."""

    def __init__(self, block_tokens: int, seed: int = 0) -> None:
        self.block_tokens = block_tokens
        self.seed = seed
        self._cache: dict[BlockKey, str] = {}

    def text(self, key: BlockKey) -> str:
        """The chunk of ``key`` (a ``(namespace, id)`` pair); the same key always gives the same text."""
        chunk = self._cache.get(key)
        if chunk is None:
            digest = xxhash.xxh3_64_intdigest(f"{self.seed}\x00{key[0]}\x00{key[1]}".encode())
            chunk = "".join(random.Random(digest).choices(VOCABULARY, k=self.block_tokens))
            self._cache[key] = chunk
        return chunk

    def join(self, keys: Iterable[BlockKey]) -> str:
        """The chunks of ``keys``, concatenated in order."""
        return "".join(self.text(k) for k in keys)
