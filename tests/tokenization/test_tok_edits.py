"""Incremental tokens and block hashes equal the from-scratch ones under random edits of rich
conversations: content part lists, tool calls with string or JSON arguments, values that compare
equal in Python but render differently (``1``/``1.0``/``True``, key order), edits, insertions and
deletions anywhere (unchanged later messages are copied, not re-encoded), system prompt and tools
changes."""

from __future__ import annotations

import asyncio
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenization.base import ChatPrompt
from tokenization.block_hash import make_hasher
from tokenization.prompt import IncrementalTokenizer
from tokenization.tiktoken_tokenizer import (
    TiktokenTokenizer,
    encode,
    plain,
    render,
    render_message,
    render_system,
)

TEXT = st.lists(st.sampled_from([*'ab c\n{}"é中', "<|im_end|>", "  ", "def "]), max_size=12).map("".join)
# Many lines, as code and tool output have: edits near their end keep a lead worth reusing.
LINES = st.lists(
    st.sampled_from(
        [
            "def f(x):\n",
            "    return x\n",
            "Hello world.\n",
            "\n",
            "  \n",
            "é中 ok\n",
            "<|im_end|>",
            "x = 1  # it's\n",
            "123456",
            "\r\n",
            "\t",
            "Über\n",
            "...\n",
        ]
    ),
    max_size=30,
).map("".join)
# Equal in Python, rendered differently: the tokenizer must not take one for the other.
TWINS = st.sampled_from([1, 1.0, True, {"a": 1, "b": 2}, {"b": 2, "a": 1}, [1], [1.0], "1", None])
PART = st.one_of(
    st.builds(lambda t: {"type": "text", "text": t}, TEXT),
    TEXT,
    st.builds(lambda v: {"type": "image_url", "image_url": {"url": "x", "detail": v}}, TWINS),
)
CALL = st.builds(
    lambda name, args: {"id": "c1", "type": "function", "function": {"name": name, "arguments": args}},
    st.sampled_from(["read", "edit"]),
    st.one_of(TEXT, st.builds(lambda v: {"path": "a.py", "n": v}, TWINS)),
)
MESSAGE = st.one_of(
    st.builds(lambda r, t: {"role": r, "content": t}, st.sampled_from(["user", "assistant", "tool"]), TEXT),
    st.builds(lambda t: {"role": "tool", "content": t}, LINES),
    st.builds(lambda parts: {"role": "user", "content": parts}, st.lists(PART, min_size=1, max_size=3)),
    st.builds(
        lambda t, calls: {"role": "assistant", "content": t, "tool_calls": calls},
        st.one_of(st.none(), TEXT),
        st.lists(CALL, min_size=1, max_size=2),
    ),
    st.builds(lambda v: {"role": "user", "content": v}, TWINS),
)
TOOLS = st.sampled_from(
    [
        None,
        [{"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}],
        [{"function": {"name": "read", "parameters": {"type": "object"}}, "type": "function"}],
        [{"type": "function", "function": {"name": "read", "strict": 1}}],
        [{"type": "function", "function": {"name": "read", "strict": True}}],
    ]
)
OP = st.one_of(
    st.tuples(st.just("append"), st.lists(MESSAGE, min_size=1, max_size=3)),
    st.tuples(st.just("replace"), st.integers(0, 30), MESSAGE),
    st.tuples(st.just("insert"), st.integers(0, 30), MESSAGE),
    st.tuples(st.just("delete"), st.integers(0, 30)),
    st.tuples(st.just("system"), st.one_of(st.none(), TEXT)),
    st.tuples(st.just("tools"), TOOLS),
    st.tuples(st.just("generation"), st.booleans()),
    # an edit near a message's end (a reminder dropped, a tool result cut): its lead is kept
    st.tuples(st.just("retail"), st.integers(0, 30), st.integers(0, 40), st.one_of(TEXT, LINES)),
)


def _apply(state: dict[str, Any], op: tuple) -> None:
    messages: list[dict[str, Any]] = state["messages"]
    kind = op[0]
    if kind == "append":
        messages.extend(op[1])
    elif kind == "replace" and messages:
        messages[op[1] % len(messages)] = op[2]
    elif kind == "insert":
        messages.insert(op[1] % (len(messages) + 1), op[2])
    elif kind == "delete" and messages:
        del messages[op[1] % len(messages)]
    elif kind == "system":
        state["system"] = op[1]
    elif kind == "tools":
        state["tools"] = op[1]
    elif kind == "generation":
        state["add_generation_prompt"] = op[1]
    elif kind == "retail" and messages:
        message = messages[op[1] % len(messages)]
        if isinstance(message.get("content"), str):
            content = message["content"]
            message["content"] = content[: max(0, len(content) - op[2])] + op[3]


def _body(state: dict[str, Any]) -> dict[str, Any]:
    """A fresh parse of the conversation, as each request is: new objects, equal values."""
    system = [] if state["system"] is None else [{"role": "system", "content": state["system"]}]
    messages = [_copy(m) for m in system + state["messages"]]
    return {
        "messages": messages,
        "tools": _copy(state["tools"]),
        "add_generation_prompt": state["add_generation_prompt"],
    }


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(OP, max_size=12),
    algo=st.sampled_from(["xxh3", "sha256"]),
    min_edit_kept=st.sampled_from([1, 8, 2048]),
)
def test_incremental_equals_scratch_under_random_edits(
    ops: list[tuple], algo: str, min_edit_kept: int
) -> None:
    tok = TiktokenTokenizer(shared_cache_bytes=0)
    tok.min_edit_kept = min_edit_kept  # small: an edited message's kept lead is reused at any length

    async def scenario() -> None:
        inc = IncrementalTokenizer(tok, make_hasher(algo, 4, "0"), offload_tokens=10_000)
        state: dict[str, Any] = {
            "messages": [],
            "tools": None,
            "system": "sys",
            "add_generation_prompt": True,
        }
        for op in [("append", [{"role": "user", "content": "hi"}]), *ops]:
            _apply(state, op)
            body = _body(state)
            got = await inc.blocks_for_chat("session", body)
            scratch = IncrementalTokenizer(TiktokenTokenizer(shared_cache_bytes=0), make_hasher(algo, 4, "0"))
            want = await scratch.blocks_for_chat(None, _body(state))
            assert list(got.tokens) == list(want.tokens), op
            assert list(got.block_hashes) == list(want.block_hashes), op
            assert got.parts == want.parts, op
            rendered = render(body["messages"], body["tools"], body["add_generation_prompt"])
            assert list(got.tokens) == encode(rendered)

    asyncio.run(scenario())


def test_plain_messages_are_those_rendered_from_strings_alone() -> None:
    assert plain({"role": "user", "content": "hi"})
    assert plain({"role": "user", "content": [{"type": "text", "text": "a"}, "b"]})
    assert plain({"role": "assistant", "content": None, "tool_calls": [CALL_STR]})
    assert plain({"role": "user", "content": "hi", "extra": {"n": 1}})  # never rendered
    assert not plain({"role": "user", "content": 1})
    assert not plain({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})
    assert not plain(
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}
    )
    assert not plain({"role": 3, "content": "hi"})


CALL_STR = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}


async def test_an_edited_message_re_encodes_only_itself() -> None:
    """The messages after it are the previous turn's ids, copied: only the edit is encoded."""
    tok = TiktokenTokenizer()
    messages = [{"role": "system", "content": "S " * 50}] + [
        {"role": "user" if i % 2 else "assistant", "content": f"message {i} " * 40} for i in range(20)
    ]
    first = tok.encode_chat(ChatPrompt(messages))
    edited = [dict(m) for m in messages]
    edited[3] = {"role": "user", "content": "changed"}
    plan = await tok.plan_chat(ChatPrompt(edited), first)
    assert plan.work == tok.size.tokens(len(render_message(edited[3])))
    second = plan.finish()
    assert second.reused == first.parts[3][1]
    assert list(second.tokens) == encode(render(edited))
    system = [{"role": "system", "content": "another system prompt " * 20}, *messages[1:]]
    plan = await tok.plan_chat(ChatPrompt(system), first)
    assert plan.work == tok.size.tokens(len(render_system(system[0]["content"], None) or ""))
    assert list(plan.finish().tokens) == encode(render(system))
