"""A sequence in a simulated rank's engine, and what flows out of it as it decodes.

``SimRequest`` is one sequence (a request with ``n > 1`` is ``n`` of them, like in vLLM); its sampled
tokens go to the request's ``OutQueue``, one word of ``OUTPUT_TOKEN_IDS`` at a time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum

from bench.sim.block_pool import Block
from tokenization.block_hash import BlockHash
from tokenization.tiktoken_tokenizer import decode, encode

# Generated text: one token per word (each a single cl100k token with its leading space, stable under
# re-encoding), so an agent sending the reply back in its next turn reproduces the decode blocks.
_WORDS = " ".join(
    [
        "the quick brown fox jumps over a lazy dog while seven small birds sing in an old green tree",
        "near the river and every child can hear them from far away",
    ]
).split(" ")
OUTPUT_TOKEN_IDS: tuple[int, ...] = tuple(encode(" " + w)[0] for w in _WORDS)
OUTPUT_TOKEN_TEXT: dict[int, str] = {t: decode([t]) for t in OUTPUT_TOKEN_IDS}


#: Outputs of a request's sequences: ``(index, token_id, finish_reason or None)``.
OutQueue = asyncio.Queue[tuple[int, int, str | None]]


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


@dataclass(eq=False, slots=True)
class SimRequest:
    """One sequence in the engine (a request with ``n > 1`` is ``n`` of them, like in vLLM)."""

    index: int
    all_token_ids: list[int]
    block_hashes: list[BlockHash]
    num_prompt_tokens: int
    max_tokens: int
    out: OutQueue
    cache_salt: str | None = None
    skip_prefix_cache: bool = False
    #: The tokens to generate, ending with a ``stop`` (scripted-tool mode); None: words until max_tokens.
    script: tuple[int, ...] | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    blocks: list[Block] = field(default_factory=list)
    num_cached_blocks: int = 0
    arrival: float = 0.0
    #: When the scheduler first gave it a step (``time.monotonic()``; 0: still waiting).
    scheduled_at: float = 0.0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class RequestTooLarge(ValueError):
    """The request can never fit the pool or the model length."""
