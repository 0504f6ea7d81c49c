"""prefixgate's predicted block hashes are the ones a real vLLM rank publishes in its KV events."""

from __future__ import annotations

import httpx

from tests.helpers.real_vllm import TOOLS, KVTap, agent_turns, chat
from tests.vllm.ranks import VllmRank
from tokenization.base import ChatPrompt
from tokenization.block_hash import BlockHasher, kv_event_hash
from tokenization.hf_tokenizer import HfTokenizer


def _check_published(
    rank: VllmRank,
    client: httpx.Client,
    tok: HfTokenizer,
    hasher: BlockHasher,
    messages: list[dict],
    tools: list[dict] | None,
    salt: str | None = None,
) -> None:
    tokens = list(tok.encode_chat(ChatPrompt(messages, tools)).tokens)
    predicted = [kv_event_hash(h) for h in hasher.hash_blocks(tokens, cache_salt=salt)]
    assert len(predicted) >= 4, "the prompt must span several full blocks"
    with KVTap(rank.kv_endpoint) as tap:
        extra = {"cache_salt": salt} if salt is not None else {}
        answer = chat(client, rank.url, messages, tools, **extra)
        assert answer.prompt_tokens == len(tokens)
        assert tap.wait_for(predicted), f"published {tap.stored_hashes()}, predicted {predicted}"
        first = next(s for s in tap.stored if predicted[0] in s.block_hashes)
    # The chain starts at block 0 (no parent) and carries exactly the prompt's leading tokens.
    assert first.parent_block_hash is None
    assert first.block_hashes == predicted[: len(first.block_hashes)]
    assert first.token_ids == tokens[: len(first.token_ids)]
    assert first.block_size == hasher.block_size


def test_block_hashes_of_a_chat_prompt_equal_the_published_ones(
    ranks: list[VllmRank], client: httpx.Client, tok: HfTokenizer, hasher: BlockHasher, nonce: str
) -> None:
    messages, tools = list(agent_turns(nonce, 3))[-1]
    _check_published(ranks[0], client, tok, hasher, messages, tools)


def test_cache_salt_changes_every_hash_as_predicted(
    ranks: list[VllmRank], client: httpx.Client, tok: HfTokenizer, hasher: BlockHasher, nonce: str
) -> None:
    messages, _ = list(agent_turns(nonce, 2))[-1]
    _check_published(ranks[1], client, tok, hasher, messages, TOOLS, salt=f"tenant-{nonce}")
