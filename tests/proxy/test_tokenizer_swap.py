"""A tokenizer found later (``proxy.fleet_tokenizer``) replaces the blocks stage's: a session's memo
made by the previous tokenizer is no base for the new one (its tokens are another tokenizer's)."""

from __future__ import annotations

from typing import Any

from proxy.stages.blocks import Blocks
from proxy.state.local import SessionLocals
from tests.proxy.test_first_turn_landing import SYSTEM, context
from tokenization.base import ChatPrompt, Encoded, Plan
from tokenization.block_hash import make_hasher
from tokenization.prompt import IncrementalTokenizer
from tokenization.tiktoken_tokenizer import TiktokenTokenizer


class Recording:
    """Tiktoken that records the previous turn's encoding it was handed for each chat prompt."""

    kind = "tiktoken"

    def __init__(self) -> None:
        self.inner = TiktokenTokenizer()
        self.bases: list[Encoded | None] = []

    async def plan_chat(self, prompt: ChatPrompt, prev: Encoded | None) -> Plan:
        self.bases.append(prev)
        return await self.inner.plan_chat(prompt, prev)

    async def plan_text(self, text: str, prev: Encoded | None, model: str | None) -> Plan:
        return await self.inner.plan_text(text, prev, model)

    def prepare_thread(self) -> None:
        self.inner.prepare_thread()


def turns(n: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [SYSTEM]
    for i in range(n):
        messages += [
            {"role": "user", "content": f"Question {i}: where is the helper called?"},
            {"role": "assistant", "content": f"Answer {i}: in the request handler."},
        ]
    return [*messages, {"role": "user", "content": "And then?"}]


async def test_a_memo_of_the_replaced_tokenizer_is_no_base_for_the_new_one() -> None:
    before, after = Recording(), Recording()
    locals_ = SessionLocals()
    stage = Blocks(IncrementalTokenizer(before, make_hasher("sha256", 16, "0")), locals_)
    await stage(context(turns(1), locals_))
    await stage(context(turns(2), locals_))
    assert before.bases[-1] is not None  # the same tokenizer builds on the previous turn

    stage.incremental = replaced = IncrementalTokenizer(after, make_hasher("sha256", 16, "0"))
    ctx = context(turns(3), locals_)
    await stage(ctx)
    assert after.bases and all(base is None for base in after.bases)
    assert ctx.conversation is not None and ctx.conversation.prompt_by is replaced
    await stage(context(turns(4), locals_))
    assert after.bases[-1] is not None  # its own memo is its base again
