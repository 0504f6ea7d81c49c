"""IncrementalTokenizer: the incremental result always equals the from-scratch result."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenization.base import UnsupportedRequest
from tokenization.block_hash import make_hasher
from tokenization.hf_tokenizer import HfTokenizer
from tokenization.prompt import IncrementalTokenizer, PromptBlocks
from tokenization.tiktoken_tokenizer import TiktokenTokenizer, encode, render

TOOLS_A = [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}]
TOOLS_B = [{"function": {"name": "read", "parameters": {"type": "object"}}, "type": "function"}]  # key order

# Text that stresses tokenizer boundaries: whitespace runs, unicode, digits, and special-token text.
PIECES = [*"ab cd\n\t.,:{}\"'0123é中—", "<|im_start|>", "<|im_end|>", "  ", "\n\n", "def "]
TEXT = st.lists(st.sampled_from(PIECES), max_size=30).map("".join)
ROLE = st.sampled_from(["user", "assistant", "tool", "system"])
MESSAGE = st.builds(lambda role, text: {"role": role, "content": text}, ROLE, TEXT)
OP = st.one_of(
    st.tuples(st.just("append"), st.lists(MESSAGE, min_size=1, max_size=3)),
    st.tuples(st.just("edit"), st.integers(0, 20), TEXT),
    st.tuples(st.just("extend"), st.integers(0, 20), TEXT),
    st.tuples(st.just("truncate"), st.integers(0, 20)),
    st.tuples(st.just("tools"), st.sampled_from([None, TOOLS_A, TOOLS_B])),
    st.tuples(st.just("generation"), st.booleans()),
    st.tuples(st.just("salt"), st.sampled_from([None, "tenant-1"])),
)


def _apply(state: dict[str, Any], op: tuple) -> None:
    messages: list[dict[str, Any]] = state["messages"]
    kind = op[0]
    if kind == "append":
        messages.extend(op[1])
    elif kind in ("edit", "extend") and messages:
        i = op[1] % len(messages)
        content = op[2] if kind == "edit" else messages[i]["content"] + op[2]
        messages[i] = {**messages[i], "content": content}
    elif kind == "truncate":
        del messages[op[1] % (len(messages) + 1) :]
    elif kind == "tools":
        state["tools"] = op[1]
    elif kind == "generation":
        state["add_generation_prompt"] = op[1]
    elif kind == "salt":
        state["cache_salt"] = op[1]


def _body(state: dict[str, Any]) -> dict[str, Any]:
    return {**state, "messages": [dict(m) for m in state["messages"]]}


def _same(a: PromptBlocks, b: PromptBlocks) -> None:
    assert list(a.tokens) == list(b.tokens)
    assert list(a.block_hashes) == list(b.block_hashes)
    assert a.parts == b.parts


def _run_sequence(make: Any, ops: list[tuple], oracle: Any) -> None:
    async def scenario() -> None:
        inc = make()
        scratch = make()
        state: dict[str, Any] = {
            "messages": [],
            "tools": None,
            "add_generation_prompt": True,
            "cache_salt": None,
        }
        for op in [("append", [{"role": "system", "content": "sys"}]), *ops]:
            _apply(state, op)
            got = await inc.blocks_for_chat("session", _body(state))
            want = await scratch.blocks_for_chat(None, _body(state))
            _same(got, want)
            assert list(got.tokens) == oracle(state)
            assert got.num_tokens == len(got.tokens) and got.num_blocks == got.num_tokens // inc.block_size

    asyncio.run(asyncio.wait_for(scenario(), timeout=30))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OP, max_size=8), algo=st.sampled_from(["sha256", "xxh3"]))
def test_tiktoken_incremental_equals_scratch(ops: list[tuple], algo: str) -> None:
    tok = TiktokenTokenizer()

    def make() -> IncrementalTokenizer:
        return IncrementalTokenizer(tok, make_hasher(algo, 4, "0"), offload_tokens=10_000)

    def oracle(state: dict[str, Any]) -> list[int]:
        return encode(render(state["messages"], state["tools"], state["add_generation_prompt"]))

    _run_sequence(make, ops, oracle)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(ops=st.lists(OP, max_size=8))
def test_hf_incremental_equals_scratch(hf_tokenizer: HfTokenizer, ops: list[tuple]) -> None:
    def make() -> IncrementalTokenizer:
        return IncrementalTokenizer(hf_tokenizer, make_hasher("sha256_cbor", 4, "0"), offload_tokens=10_000)

    def oracle(state: dict[str, Any]) -> list[int]:
        from tokenization.base import ChatPrompt

        text = hf_tokenizer.render(
            ChatPrompt(state["messages"], state["tools"], state["add_generation_prompt"])
        )
        return hf_tokenizer.encode_text(text)

    _run_sequence(
        make, [op for op in ops if op[0] != "append" or all(m["role"] != "system" for m in op[1])], oracle
    )


async def test_appended_turn_reuses_blocks_and_hashes_only_new_ones() -> None:
    inc = IncrementalTokenizer(TiktokenTokenizer(), make_hasher("sha256", 16, "0"))
    messages = [{"role": "system", "content": "S " * 300}, {"role": "user", "content": "hello " * 200}]
    first = await inc.blocks_for_chat("s", {"messages": messages})
    assert first.reused_blocks == 0
    messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "next " * 50}]
    second = await inc.blocks_for_chat("s", {"messages": messages})
    # Everything up to the old generation prompt is reused, block hashes included.
    assert second.reused_tokens == first.parts[-1][1]
    assert second.reused_blocks == second.reused_tokens // 16
    assert list(second.block_hashes[: second.reused_blocks]) == list(
        first.block_hashes[: second.reused_blocks]
    )
    assert second.part_at(0) == "system" and second.part_at(second.num_tokens - 1) == "generation_prompt"
    assert second.part_at(second.num_tokens) is None
    assert second.kv_event_hashes()[0] == int.from_bytes(second.block_hashes[0][-8:], "big")


async def test_salt_change_rehashes_everything_but_keeps_tokens() -> None:
    inc = IncrementalTokenizer(TiktokenTokenizer(), make_hasher("sha256", 16, "0"))
    body = {"messages": [{"role": "user", "content": "word " * 100}]}
    plain = await inc.blocks_for_chat("s", body)
    salted = await inc.blocks_for_chat("s", {**body, "cache_salt": "t1"})
    assert salted.reused_tokens == plain.num_tokens and salted.reused_blocks == 0
    assert all(a != b for a, b in zip(plain.block_hashes, salted.block_hashes, strict=True))
    with pytest.raises(UnsupportedRequest):
        await inc.blocks_for_chat("s", {**body, "cache_salt": 5})


async def test_large_work_runs_in_a_worker_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    import tokenization.prompt as prompt_module

    calls: list[str] = []
    real = asyncio.to_thread

    async def spy(fn: Any, *args: Any) -> Any:
        calls.append(getattr(fn, "__name__", "?"))
        return await real(fn, *args)

    monkeypatch.setattr(prompt_module.asyncio, "to_thread", spy)
    inc = IncrementalTokenizer(TiktokenTokenizer(), make_hasher("sha256", 16, "0"), offload_tokens=500)
    messages = [{"role": "user", "content": "lorem ipsum dolor " * 400}]
    big = await inc.blocks_for_chat("s", {"messages": messages})
    assert calls == ["finish", "_hash"]
    calls.clear()
    messages += [{"role": "assistant", "content": "short"}]
    small = await inc.blocks_for_chat("s", {"messages": messages})
    assert calls == []  # a small increment runs inline
    assert list(small.tokens) == encode(render(messages))
    assert big.num_blocks > 0


async def test_session_cache_budget_evicts_least_recent() -> None:
    inc = IncrementalTokenizer(TiktokenTokenizer(), make_hasher("xxh3", 16, "0"), cache_bytes=10**6)
    body = {"messages": [{"role": "user", "content": "some words here " * 500}]}
    await inc.blocks_for_chat("a", body)
    one = inc.sessions.nbytes_of("a")
    # 1.5k tokens: 6 KB of ids and ~100 hashes at least.
    assert one is not None and 1500 * 4 + 90 * 16 < one < 50_000
    inc.sessions.budget_bytes = int(one * 2.5)  # room for two sessions
    await inc.blocks_for_chat("b", body)
    await inc.blocks_for_chat("a", body)  # touch a: b is now the least recent
    await inc.blocks_for_chat("c", body)
    assert inc.sessions.nbytes <= inc.sessions.budget_bytes and len(inc.sessions) == 2
    assert inc.sessions.nbytes_of("b") is None and inc.sessions.nbytes_of("a") is not None
    assert inc.sessions.evictions >= 1
    again = await inc.blocks_for_chat("a", body)
    assert again.reused_tokens == again.num_tokens


async def test_completion_prompts_text_and_token_ids() -> None:
    inc = IncrementalTokenizer(TiktokenTokenizer(), make_hasher("sha256", 16, "0"))
    text = "def f(x):\n    return x * 2\n" * 20
    first = await inc.blocks_for_completion("s", {"prompt": text})
    assert list(first.tokens) == encode(text)
    longer = await inc.blocks_for_completion("s", {"prompt": text + "print(f(3))"})
    assert longer.reused_blocks >= first.num_blocks - 1
    assert list(longer.block_hashes) == inc.hasher.hash_blocks(encode(text + "print(f(3))"))
    ids = await inc.blocks_for_completion("s", {"prompt": list(longer.tokens)})
    assert list(ids.block_hashes) == list(longer.block_hashes) and ids.reused_blocks == longer.num_blocks
    # A chat turn in the same session does not reuse a completion's state.
    chat = await inc.blocks_for_chat("s", {"messages": [{"role": "user", "content": text}]})
    assert chat.reused_tokens == 0
    for bad in ({"prompt": ["a", "b"]}, {"prompt": [1, -2]}, {}):
        with pytest.raises(UnsupportedRequest):
            await inc.blocks_for_completion("s", bad)
