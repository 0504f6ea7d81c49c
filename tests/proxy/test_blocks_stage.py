"""The blocks stage computes exactly the block hashes of the configured chain (a simulated rank's sha256,
or the default internal xxh3)."""

from __future__ import annotations

import time

import pytest
from starlette.datastructures import Headers

from proxy.apis import CHAT
from proxy.apis.base import Api
from proxy.context import RequestContext
from proxy.stages.blocks import Blocks
from proxy.state.local import SessionLocals
from tokenization.block_hash import BlockHasher, make_hasher
from tokenization.config import TokenizerConfig
from tokenization.factory import build_incremental
from tokenization.tiktoken_tokenizer import encode, render


def context(body: dict, api: Api = CHAT) -> RequestContext:
    return RequestContext(
        api=api,
        headers=Headers(),
        raw_body=b"",
        body=body,
        stream=False,
        model=None,
        started=time.perf_counter(),
    )


@pytest.mark.parametrize(
    ("config", "reference"),
    [
        ({"hash_algo": "sha256"}, BlockHasher(16)),  # the rank's own hashing, when asked for
        ({}, make_hasher("xxh3", 16)),  # the default (auto): the fast internal chain
    ],
)
async def test_chat_blocks_match_the_reference_hashing_and_grow_incrementally(config, reference):
    locals_ = SessionLocals()
    stage = Blocks(build_incremental(TokenizerConfig.model_validate(config), block_size=16), locals_)
    messages = [
        {"role": "system", "content": "You are an agent. " * 30},
        {"role": "user", "content": "Fix it."},
    ]
    ctx = context({"messages": messages})
    ctx.session_key, ctx.local = "s1", locals_.open("s1")
    await stage(ctx)
    expected_tokens = encode(render(messages))
    assert ctx.prompt_tokens == len(expected_tokens)
    assert list(ctx.block_hashes) == reference.hash_blocks(expected_tokens)

    longer = [*messages, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Next."}]
    ctx2 = context({"messages": longer})
    ctx2.session_key, ctx2.local = "s1", locals_.open("s1")
    await stage(ctx2)
    assert list(ctx2.block_hashes) == reference.hash_blocks(encode(render(longer)))
    assert ctx2.prompt_blocks is not None and ctx2.prompt_blocks.reused_blocks > 0


async def test_unrenderable_request_is_left_to_the_rank():
    stage = Blocks(build_incremental(TokenizerConfig.model_validate({}), block_size=16), SessionLocals())
    ctx = context({"messages": "not a list"})
    await stage(ctx)
    assert ctx.prompt_tokens is None and not ctx.block_hashes


async def test_disabled_stage_does_nothing():
    ctx = context({"messages": [{"role": "user", "content": "hi"}]})
    await Blocks(None, SessionLocals())(ctx)
    assert ctx.prompt_tokens is None
