"""What rendering and hashing a prompt gives (``tokenization.prompt.IncrementalTokenizer``): its
blocks, the memo its session's next turn starts from, and the head a turn is routed on before its
whole prompt is tokenized."""

from __future__ import annotations

import bisect
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from tokenization.base import Encoded, Part
from tokenization.block_hash import BlockHash, kv_event_hash


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """A prompt as the rank will cache it. ``tokens`` and ``block_hashes`` are shared: do not mutate."""

    num_tokens: int
    block_size: int
    block_hashes: Sequence[BlockHash]  # full blocks only, chained from block 0
    parts: tuple[Part, ...]  # (label, first token, end token), covering [0, num_tokens)
    #: Typecode "I"; the prompt's ids are its first ``num_tokens`` (all of them, but for a returning
    #: turn's kept blocks, which share the previous turn's array: ``PromptHead``).
    tokens: array
    reused_tokens: int = 0  # leading tokens taken from the session's previous turn without re-encoding
    reused_blocks: int = 0  # leading block hashes taken from the previous turn
    shared_blocks: int = 0  # leading block hashes taken from the cross-session cache (not hashed here)
    #: Leading tokens of the segment sessions of one agent share (system prompt + tools), as the
    #: tokenizer marks it (``Encoded.shared_tokens``): the prompt's *head*.
    shared_tokens: int = 0
    #: What the next turn of this session starts from (``IncrementalTokenizer.chat_blocks``), and
    #: about how many bytes it holds.
    memo: PromptMemo | None = None
    memo_bytes: int = 0

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    def part_at(self, token_index: int) -> str | None:
        """Label of the request part holding ``token_index`` (e.g. the first token of a broken block)."""
        i = bisect.bisect_right(self.parts, token_index, key=_part_start) - 1
        if i >= 0 and self.parts[i][1] <= token_index < self.parts[i][2]:
            return self.parts[i][0]
        return None

    def head(self) -> tuple[str | None, int]:
        """The head in full blocks: (its key, its tokens), or (None, 0) without one. The key is the
        hex of the head's last block hash, which (chained) names the whole head and its salt: the one
        identity of an agent's system + tools, the same for every session of that agent."""
        full = min(self.shared_tokens // self.block_size, len(self.block_hashes))
        if full == 0:
            return None, 0
        last = self.block_hashes[full - 1]
        return (last.hex() if isinstance(last, bytes) else str(last)), full * self.block_size

    def kv_event_hashes(self) -> list[int]:
        """The uint64 form vLLM publishes in KV events."""
        return [kv_event_hash(h) for h in self.block_hashes]


@dataclass(frozen=True, slots=True)
class PromptMemo:
    """One turn as the next turn of its session reuses it."""

    kind: str  # "chat" or "text": an Encoded is only a valid base for the same kind
    encoded: Encoded
    salt: str | None
    hashes: list[BlockHash]


@dataclass(frozen=True, slots=True)
class PromptHead:
    """A turn as routing can see it before the whole prompt is tokenized: a session's first turn by
    its head (``IncrementalTokenizer.first_chat_blocks``: ``blocks`` covers the head alone, its
    ``shared_tokens`` are all its tokens), a returning turn by the blocks it keeps of the previous
    turn (``returning_chat_blocks``). ``blocks`` has no memo; ``estimated_tokens`` sizes the whole
    prompt from its text; ``rest()`` tokenizes and hashes the whole prompt (reusing those blocks).
    ``on_loop``: ``rest()`` is a short tail's work, done on the calling event loop (no worker-thread
    hop) while the request waits for its rank, so it lands before the rank can answer."""

    blocks: PromptBlocks
    estimated_tokens: int
    rest: Callable[[], Awaitable[PromptBlocks]]
    on_loop: bool = False


def _part_start(part: Part) -> int:
    return part[1]
