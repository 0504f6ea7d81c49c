"""A returning turn that added much goes on with the blocks it keeps of its previous turn
(``IncrementalTokenizer.returning_chat_blocks``): those are exactly the leading blocks of its whole
prompt, and the rest, finished beside it, is exactly what tokenizing it on the path gives."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.tokenization.test_tok_incremental import OP, _apply, _body, _same
from tokenization.base import Tokenizer
from tokenization.block_hash import make_hasher
from tokenization.hf_tokenizer import HfTokenizer
from tokenization.prompt import IncrementalTokenizer, PromptBlocks, PromptHead, PromptMemo
from tokenization.tiktoken_tokenizer import TiktokenTokenizer

SYSTEM = {"role": "system", "content": "You are a coding agent. Follow the repository's conventions. " * 40}
TAIL = "def function_{i}(x):\n    return x * {i} + helper(x - {i})\n"


def incremental(tokenizer: Tokenizer, ahead_tokens: int, algo: str = "sha256") -> IncrementalTokenizer:
    hasher = make_hasher(algo, 4, "0")
    return IncrementalTokenizer(tokenizer, hasher, ahead_tokens=ahead_tokens, loop_tokens=0)


def run_turns(tokenizer: Tokenizer, ops: list[tuple], algo: str) -> int:
    """Each state of ``ops`` as a session's turns, every returning turn ahead when it keeps a block;
    returns how many went ahead."""

    async def scenario() -> int:
        inc, scratch = incremental(tokenizer, 0, algo), incremental(tokenizer, 0, algo)
        state: dict[str, Any] = {
            "messages": [],
            "tools": None,
            "add_generation_prompt": True,
            "cache_salt": None,
        }
        memo: PromptMemo | None = None
        ahead = 0
        for op in [("append", [{"role": "system", "content": "sys"}]), *ops]:
            _apply(state, op)
            body = _body(state)
            got = await (inc.chat_blocks(body) if memo is None else inc.returning_chat_blocks(body, memo))
            if isinstance(got, PromptHead):
                ahead += 1
                head = got.blocks
                whole = await got.rest()
                assert head.num_blocks >= 1 and head.num_tokens == head.num_blocks * head.block_size
                assert list(head.block_hashes) == list(whole.block_hashes[: head.num_blocks])
                assert head.num_tokens <= len(head.tokens)  # the kept ids lead a shared array
                assert list(head.tokens[: head.num_tokens]) == list(whole.tokens[: head.num_tokens])
                assert head.memo is None and got.estimated_tokens >= head.num_tokens
                got = whole
            assert isinstance(got, PromptBlocks)
            _same(got, await scratch.chat_blocks(body))
            memo = got.memo
        return ahead

    return asyncio.run(asyncio.wait_for(scenario(), timeout=30))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OP, max_size=8), algo=st.sampled_from(["sha256", "xxh3"]))
def test_tiktoken_ahead_blocks_lead_the_whole_prompt(ops: list[tuple], algo: str) -> None:
    run_turns(TiktokenTokenizer(), ops, algo)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=st.lists(OP, max_size=8))
def test_hf_ahead_blocks_lead_the_whole_prompt(hf_tokenizer: HfTokenizer, ops: list[tuple]) -> None:
    system_free = [op for op in ops if op[0] != "append" or all(m["role"] != "system" for m in op[1])]
    run_turns(hf_tokenizer, system_free, "sha256_cbor")


def test_an_appended_turn_goes_ahead_with_its_hf_and_tiktoken_tokenizers(hf_tokenizer: HfTokenizer) -> None:
    """Not a vacuous property: the plain agent shape (a turn appended) does go ahead."""
    appended = [("append", [{"role": "user", "content": "hello there " * 20}])] * 3
    assert run_turns(TiktokenTokenizer(), appended, "sha256") == 3
    assert run_turns(hf_tokenizer, appended, "sha256_cbor") == 3


async def test_a_long_tail_goes_ahead_and_a_short_one_or_a_new_salt_does_not() -> None:
    inc = IncrementalTokenizer(TiktokenTokenizer(), make_hasher("sha256", 16, "0"), ahead_tokens=256)
    first = [SYSTEM, {"role": "user", "content": "Read the module."}]
    base = await inc.chat_blocks({"messages": first})
    assert base.memo is not None
    code = "".join(TAIL.format(i=i) for i in range(60))  # ~1.5k tokens of code
    long_turn = {
        "messages": [*first, {"role": "assistant", "content": "Read."}, {"role": "user", "content": code}]
    }
    got = await inc.returning_chat_blocks(long_turn, base.memo)
    assert isinstance(got, PromptHead) and not got.on_loop  # over ahead_tokens: a worker thread's
    whole = await got.rest()
    # the previous prompt's full blocks up to its generation prompt, which this turn replaced
    assert got.blocks.num_blocks == whole.reused_blocks == base.num_blocks - 1
    assert got.blocks.head() == base.head() == whole.head()  # admission's identity of the agent's head
    assert abs(got.estimated_tokens - whole.num_tokens) < whole.num_tokens // 4

    short_turn = {
        "messages": [*first, {"role": "assistant", "content": "Read."}, {"role": "user", "content": "Go."}]
    }
    assert isinstance(await inc.returning_chat_blocks(short_turn, base.memo), PromptBlocks)  # on the path
    medium = {"role": "user", "content": code[:800]}  # ~200 tokens: from loop_tokens to ahead_tokens
    medium_turn = {"messages": [*first, {"role": "assistant", "content": "Read."}, medium]}
    on_loop = await inc.returning_chat_blocks(medium_turn, base.memo)
    assert isinstance(on_loop, PromptHead) and on_loop.on_loop  # the event loop's, while the rank works
    assert on_loop.blocks.num_blocks == base.num_blocks - 1
    _same(await on_loop.rest(), await scratch_blocks(medium_turn))
    salted = {**long_turn, "cache_salt": "tenant-2"}  # the salt is in block 0: nothing is kept
    assert isinstance(await inc.returning_chat_blocks(salted, base.memo), PromptBlocks)
    again = await inc.returning_chat_blocks({"messages": first}, base.memo)  # nothing new to encode
    assert isinstance(again, PromptBlocks) and list(again.block_hashes) == list(base.block_hashes)


async def scratch_blocks(body: dict[str, Any]) -> PromptBlocks:
    """``body``'s blocks tokenized from scratch."""
    return await IncrementalTokenizer(TiktokenTokenizer(), make_hasher("sha256", 16, "0")).chat_blocks(body)


async def test_by_default_only_worker_thread_work_goes_to_a_worker_thread() -> None:
    """Below ``offload_tokens`` the tail is encoded on the event loop: a thread hop costs more than it
    saves."""
    inc = IncrementalTokenizer(TiktokenTokenizer(), make_hasher("sha256", 16, "0"), offload_tokens=2000)
    first = [SYSTEM, {"role": "user", "content": "Read the module."}]
    base = await inc.chat_blocks({"messages": first})
    assert base.memo is not None

    def turn(functions: int) -> dict[str, Any]:
        code = "".join(TAIL.format(i=i) for i in range(functions))
        return {
            "messages": [*first, {"role": "assistant", "content": "Read."}, {"role": "user", "content": code}]
        }

    short = await inc.returning_chat_blocks(turn(60), base.memo)
    long = await inc.returning_chat_blocks(turn(400), base.memo)
    assert isinstance(short, PromptHead) and short.on_loop  # ~1.5k tokens
    assert isinstance(long, PromptHead) and not long.on_loop  # ~10k tokens
