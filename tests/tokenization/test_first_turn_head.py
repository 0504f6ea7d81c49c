"""A session's first turn: its head (system prompt + tools) encoded and hashed once for a wave of new
sessions, and, when the rest is long, given at once with the rest to finish (``PromptHead``)."""

from __future__ import annotations

import asyncio
from typing import Any

from tokenization.block_hash import make_hasher
from tokenization.prompt import IncrementalTokenizer, PromptBlocks, PromptHead
from tokenization.tiktoken_tokenizer import TiktokenTokenizer

SYSTEM = {"role": "system", "content": "You are a coding agent. Follow the repository's conventions. " * 40}
TOOLS = [
    {"type": "function", "function": {"name": f"tool_{i}", "description": "Does a thing. " * 20}}
    for i in range(6)
]


def body(user: str) -> dict[str, Any]:
    return {"messages": [SYSTEM, {"role": "user", "content": user}], "tools": TOOLS}


class CountingHasher:
    """The real hasher, counting the chains hashed from block 0 (a head hashed from scratch)."""

    def __init__(self) -> None:
        self.inner = make_hasher("sha256", 16, "0")
        self.block_size = self.inner.block_size
        self.none_hash = self.inner.none_hash
        self.from_scratch = 0

    def hash_blocks(
        self, tokens: Any, *, start_block: int = 0, parent: Any = None, cache_salt: Any = None
    ) -> Any:
        if start_block == 0:
            self.from_scratch += 1
        return self.inner.hash_blocks(tokens, start_block=start_block, parent=parent, cache_salt=cache_salt)


def reference() -> IncrementalTokenizer:
    return IncrementalTokenizer(TiktokenTokenizer(), make_hasher("sha256", 16, "0"))


async def test_a_long_first_turn_gives_its_head_first_then_exactly_the_whole_prompts_blocks() -> None:
    inc = IncrementalTokenizer(TiktokenTokenizer(), make_hasher("sha256", 16, "0"), offload_tokens=500)
    request = body("Please refactor this module. " * 600)
    first = await inc.first_chat_blocks(request)
    expected = await reference().chat_blocks(request)
    assert isinstance(first, PromptHead)
    head = first.blocks
    assert head.num_tokens == expected.shared_tokens > 16
    assert list(head.block_hashes) == list(expected.block_hashes[: head.num_blocks])
    assert head.head() == expected.head()  # admission's one identity of the agent's head
    assert head.num_tokens < first.estimated_tokens
    whole = await first.rest()
    assert list(whole.tokens) == list(expected.tokens)
    assert list(whole.block_hashes) == list(expected.block_hashes)
    assert whole.parts == expected.parts and whole.shared_tokens == expected.shared_tokens
    assert whole.memo is not None and whole.memo.hashes == list(expected.block_hashes)
    assert whole.shared_blocks == head.num_blocks  # the head's hashes were not computed twice


async def test_a_short_first_turn_is_blocks_at_once() -> None:
    inc = IncrementalTokenizer(TiktokenTokenizer(), make_hasher("sha256", 16, "0"), offload_tokens=500)
    request = body("Fix the failing test.")
    first = await inc.first_chat_blocks(request)
    expected = await reference().chat_blocks(request)
    assert isinstance(first, PromptBlocks)
    assert list(first.block_hashes) == list(expected.block_hashes)


async def test_a_wave_of_new_sessions_encodes_and_hashes_the_head_once() -> None:
    hasher = CountingHasher()
    tokenizer = TiktokenTokenizer()
    inc = IncrementalTokenizer(tokenizer, hasher, offload_tokens=100)
    requests = [body(f"Task number {i}: fix it.") for i in range(6)]
    results = await asyncio.gather(*(inc.first_chat_blocks(r) for r in requests))
    assert hasher.from_scratch == 1
    assert len(tokenizer.shared) == 1
    for request, got in zip(requests, results, strict=True):
        expected = await reference().chat_blocks(request)
        assert isinstance(got, PromptBlocks)
        assert list(got.tokens) == list(expected.tokens)
        assert list(got.block_hashes) == list(expected.block_hashes)
