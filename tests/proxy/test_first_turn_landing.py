"""A long first turn goes on with its head's blocks before its whole prompt is tokenized; the whole
prompt lands on its context and its thread's memo, and the thread's next turn starts from it.

The tokenizer double blocks the whole prompt's encoding until the test releases it: what the stage
and the gateway do meanwhile is observed without any timing."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import replace
from typing import Any

import httpx

from bench.sim import SimRankServer
from proxy.context import RequestContext
from proxy.server import ServerThread
from proxy.stages.blocks import Blocks
from proxy.state.local import SessionLocals
from tests.helpers.gateway import gateway_app
from tests.helpers.ranks import RankServers
from tests.helpers.wait import wait_until
from tests.proxy.test_blocks_stage import context as blocks_context
from tokenization.base import ChatPrompt, Encoded, Plan
from tokenization.block_hash import make_hasher
from tokenization.prompt import IncrementalTokenizer
from tokenization.tiktoken_tokenizer import TiktokenTokenizer

SYSTEM = {"role": "system", "content": "You are a coding agent. Follow the repository's conventions. " * 40}
LONG = "Here is the whole file to review, line by line, with its history. " * 700  # ~10k tokens


class HeldTokenizer:
    """Tiktoken whose plans finish only once ``release`` is set (the head is given as usual)."""

    kind = "tiktoken"

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.release = threading.Event()
        self.started = threading.Event()

    async def plan_chat(self, prompt: ChatPrompt, prev: Encoded | None) -> Plan:
        plan = await self.inner.plan_chat(prompt, prev)
        return replace(plan, finish=self._held(plan))

    async def plan_text(self, text: str, prev: Encoded | None, model: str | None) -> Plan:
        plan = await self.inner.plan_text(text, prev, model)
        return replace(plan, finish=self._held(plan))

    def prepare_thread(self) -> None:
        self.inner.prepare_thread()

    def _held(self, plan: Plan) -> Any:
        def finish() -> Encoded:
            self.started.set()
            assert self.release.wait(60), "the test never released the tokenizer"
            return plan.finish()

        return finish


def context(messages: list[dict[str, Any]], locals_: SessionLocals) -> RequestContext:
    ctx = blocks_context({"messages": messages})
    ctx.session_key, ctx.local = "s1", locals_.open("s1")
    return ctx


async def reference_blocks(messages: list[dict[str, Any]]) -> Any:
    inc = IncrementalTokenizer(TiktokenTokenizer(), make_hasher("sha256", 16, "0"))
    return await inc.chat_blocks({"messages": messages})


async def test_a_first_turn_goes_on_with_its_head_and_its_next_turn_waits_for_the_rest() -> None:
    held = HeldTokenizer(TiktokenTokenizer())
    locals_ = SessionLocals()
    stage = Blocks(IncrementalTokenizer(held, make_hasher("sha256", 16, "0"), offload_tokens=500), locals_)
    first = [SYSTEM, {"role": "user", "content": LONG}]
    expected = await reference_blocks(first)

    ctx = context(first, locals_)
    await stage(ctx)  # returns although the whole prompt's encoding is held
    assert ctx.landing is not None and not ctx.landing.done() and not held.release.is_set()
    head_blocks = expected.shared_tokens // 16
    assert list(ctx.block_hashes) == list(expected.block_hashes[:head_blocks])
    assert ctx.prompt_tokens is not None and ctx.prompt_tokens > expected.shared_tokens
    thread = ctx.conversation
    assert thread is not None and thread.prompt is None and thread.landing is ctx.landing

    second = [*first, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Next."}]
    ctx2 = context(second, locals_)
    next_turn = asyncio.create_task(stage(ctx2))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not next_turn.done()  # it starts from the first turn's memo: it waits for it

    held.release.set()
    await ctx.landing
    assert ctx.prompt_tokens == expected.num_tokens
    assert list(ctx.block_hashes) == list(expected.block_hashes)
    assert ctx.prompt_blocks is not None and ctx.prompt_blocks.memo is not None
    assert thread.prompt is ctx.prompt_blocks.memo and thread.landing is None

    await next_turn
    expected2 = await reference_blocks(second)
    assert list(ctx2.block_hashes) == list(expected2.block_hashes)
    assert ctx2.prompt_blocks is not None and ctx2.prompt_blocks.reused_blocks == expected.num_blocks
    assert ctx2.landing is None


async def test_a_first_turn_that_cannot_be_rendered_is_still_answered_without_blocks() -> None:
    class Failing(HeldTokenizer):
        def _held(self, plan: Plan) -> Any:
            def finish() -> Encoded:
                raise RuntimeError("tokenizer broke")

            return finish

    locals_ = SessionLocals()
    stage = Blocks(
        IncrementalTokenizer(
            Failing(TiktokenTokenizer()), make_hasher("sha256", 16, "0"), offload_tokens=500
        ),
        locals_,
    )
    ctx = context([SYSTEM, {"role": "user", "content": LONG}], locals_)
    await stage(ctx)
    assert ctx.landing is not None and ctx.block_hashes
    await ctx.landing  # never raises
    assert ctx.prompt_blocks is None and ctx.prompt_tokens is None and not ctx.block_hashes
    thread = ctx.conversation
    assert thread is not None and thread.prompt is None and thread.landing is None


def chat(url: str, messages: list[dict[str, Any]]) -> httpx.Response:
    body = {"model": "m", "messages": messages, "max_tokens": 4}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers={"x-session-id": "s1"}, timeout=30)
    assert response.status_code == 200, response.text
    return response


def two_turns(ranks: list[SimRankServer], held: bool) -> tuple[list[int], int]:
    """A session's first two turns through prefixgate: the estimated cached tokens of each, and the
    first turn's blocks (``held``: the first turn's whole prompt is held until it was answered;
    else it is tokenized on the request's path, as before)."""
    first = [SYSTEM, {"role": "user", "content": LONG * 2}]
    second = [*first, {"role": "assistant", "content": "Done."}, {"role": "user", "content": "Next."}]
    app = gateway_app(ranks, policy="prefix_affinity")
    server = ServerThread(app).start()
    try:
        gateway = app.state.gateway
        incremental = gateway.pipeline.blocks.incremental
        tokenizer = HeldTokenizer(incremental.tokenizer)
        if held:
            incremental.tokenizer = tokenizer
        else:
            incremental.offload_tokens = 10**9
        answer = chat(server.url, first)
        if held:  # answered while the whole prompt's encoding is still held
            assert tokenizer.started.is_set() and not tokenizer.release.is_set()
            tokenizer.release.set()
        key = answer.headers["x-prefixgate-session"]
        local = wait_until(lambda: gateway.locals.get(key))
        memo = wait_until(lambda: local.main.prompt, "the first turn's memo never landed")
        index = gateway.router.index
        wait_until(
            lambda: max(index.match(memo.hashes).values(), default=0) == len(memo.hashes),
            "the first turn's blocks never reached the index",
        )
        # the explainer learnt the whole first prompt, not its head (routed waits for the landing)
        turn = wait_until(lambda: local.main.turn, "the explainer never saw the first turn")
        assert turn.num_tokens == len(memo.encoded.tokens)
        again = chat(server.url, second)
        estimates = [
            int(answer.headers["x-prefixgate-estimated-cached-tokens"]),
            int(again.headers["x-prefixgate-estimated-cached-tokens"]),
        ]
        return estimates, len(memo.hashes)
    finally:
        server.stop()


def test_a_first_turn_is_forwarded_before_its_whole_prompt_is_tokenized(rank_servers: RankServers) -> None:
    held, blocks = two_turns(rank_servers.sim(2), held=True)
    inline, inline_blocks = two_turns(rank_servers.sim(2), held=False)
    assert held == inline and blocks == inline_blocks
    assert held[1] >= blocks * 16  # the next turn expects the whole first prompt, not just its head


def test_a_first_turn_answered_before_its_prompt_landed_leaves_nothing_queued(
    rank_servers: RankServers,
) -> None:
    """Answered whole while its whole prompt's encoding is held here: the rank's prefill is done, so
    nothing stays queued on the rank (routing and admission weigh that queue), though the request's
    end waits for the landing."""
    app = gateway_app(rank_servers.sim(2), policy="prefix_affinity")
    server = ServerThread(app).start()
    try:
        gateway = app.state.gateway
        incremental = gateway.pipeline.blocks.incremental
        tokenizer = HeldTokenizer(incremental.tokenizer)
        incremental.tokenizer = tokenizer
        answer = chat(server.url, [SYSTEM, {"role": "user", "content": LONG * 2}])
        rank = answer.headers["x-prefixgate-backend"]
        assert tokenizer.started.is_set() and not tokenizer.release.is_set()  # still landing
        assert gateway.router.queued_prefill[rank] == 0
        assert gateway.router.inflight_tokens[rank] > 0  # its end waits for the landing
        tokenizer.release.set()
        wait_until(lambda: gateway.router.inflight_tokens[rank] == 0, "the request never ended")
    finally:
        tokenizer.release.set()
        server.stop()
