"""Incremental tokenization and hashing equal the from-scratch result, and do less work."""

from __future__ import annotations

from bench.sim.prompts import PromptProcessor, split_segments
from tokenization.block_hash import BlockHasher
from tokenization.tiktoken_tokenizer import encode, render


def test_follow_up_turns_reuse_segments_and_chains() -> None:
    hasher = BlockHasher(16, "sha256", "0")
    proc = PromptProcessor(hasher)
    tools = [{"type": "function", "function": {"name": "grep"}}]
    messages: list[dict] = [{"role": "system", "content": "Rules. " * 500}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"step {turn}: " + "data " * 200})
        before = proc.blocks_hashed
        prompt = proc.chat(messages, tools, cache_salt="t" if turn == 3 else None)
        tokens = encode(render(messages, tools))
        assert prompt.token_ids == tokens
        assert prompt.block_hashes == hasher.hash_blocks(tokens, cache_salt="t" if turn == 3 else None)
        if 0 < turn < 3:
            # only the blocks after the previous turn's prompt (minus its generation prompt) are hashed
            assert proc.blocks_hashed - before <= 250 // 16 + 2
        messages.append({"role": "assistant", "content": f"done {turn}"})
    assert proc.segments_encoded < 4 * len(messages)


def test_text_prompt_split_equals_whole_encoding() -> None:
    proc = PromptProcessor(BlockHasher(16))
    text = render([{"role": "system", "content": "a b c"}, {"role": "user", "content": "<|im_start|> x y"}])
    assert "".join(split_segments(text)) == text
    assert proc.text(text).token_ids == encode(text)
    assert proc.text("plain text without specials").token_ids == encode("plain text without specials")
