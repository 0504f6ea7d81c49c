"""A returning turn that added a long tail goes on with the blocks it keeps of its previous turn; its
whole prompt lands on its context and its thread beside the request (``proxy.stages.blocks``).

As in ``test_first_turn_landing``, the tokenizer double holds the encoding until the test releases
it, so what happens meanwhile is observed without any timing."""

from __future__ import annotations

from typing import Any

from proxy.server import ServerThread
from proxy.stages.blocks import Blocks
from proxy.state.local import Answer, SessionLocals
from tests.helpers.gateway import gateway_app
from tests.helpers.ranks import RankServers
from tests.helpers.wait import wait_until
from tests.proxy.test_first_turn_landing import SYSTEM, HeldTokenizer, chat, context, reference_blocks
from tokenization.block_hash import make_hasher
from tokenization.prompt import IncrementalTokenizer
from tokenization.tiktoken_tokenizer import TiktokenTokenizer, encode

FIRST = [SYSTEM, {"role": "user", "content": "Read the module and find where the helper is called."}]
ANSWER = "I read it; the helper is called from three places, all in the request handler. " * 3
CODE = "".join(f"def function_{i}(x):\n    return x * {i} + helper(x - {i})\n" for i in range(80))


def second_turn(answer: str) -> list[dict[str, Any]]:
    return [*FIRST, {"role": "assistant", "content": answer}, {"role": "user", "content": CODE}]


async def test_a_returning_turn_goes_on_with_its_kept_blocks_and_lands_with_its_answer() -> None:
    held = HeldTokenizer(TiktokenTokenizer())
    held.release.set()  # the first turn is short: tokenized on its path
    locals_ = SessionLocals()
    stage = Blocks(IncrementalTokenizer(held, make_hasher("sha256", 16, "0"), ahead_tokens=256), locals_)
    ctx1 = context(FIRST, locals_)
    await stage(ctx1)
    thread = ctx1.conversation
    assert ctx1.landing is None and ctx1.prompt_tokens is not None and thread is not None
    thread.answer = Answer("rank0", ctx1.prompt_tokens, len(encode(ANSWER)))

    held.release.clear()
    held.started.clear()
    second = second_turn(ANSWER)
    expected = await reference_blocks(second)
    ctx2 = context(second, locals_)
    await stage(ctx2)  # returns although its tail's encoding is held
    assert ctx2.landing is not None and not ctx2.landing.done() and thread.landing is ctx2.landing
    kept = len(ctx2.block_hashes)
    assert len(ctx1.block_hashes) - 1 <= kept <= len(ctx1.block_hashes)  # up to its generation prompt
    assert list(ctx2.block_hashes) == list(expected.block_hashes[:kept])
    assert (
        ctx2.prompt_tokens is not None
        and abs(ctx2.prompt_tokens - expected.num_tokens) < expected.num_tokens // 4
    )
    assert ctx2.cached_answer is None  # known once the whole prompt lands

    held.release.set()
    await ctx2.landing
    assert ctx2.prompt_tokens == expected.num_tokens
    assert list(ctx2.block_hashes) == list(expected.block_hashes)
    answered = ctx2.cached_answer
    assert answered is not None and answered.rank == "rank0" and answered.blocks > len(ctx1.block_hashes)
    assert ctx2.prompt_blocks is not None and thread.prompt is ctx2.prompt_blocks.memo
    assert thread.landing is None


def three_turns(rank_servers: RankServers, ahead: bool) -> tuple[list[int], list[str], int]:
    """A session's three turns through prefixgate, the second adding ~2k tokens of code: the
    estimated cached tokens and the rank of each, and the second prompt's blocks (``ahead``: its
    tail's encoding is held until it was answered; else it is tokenized on the request's path)."""
    app = gateway_app(rank_servers.sim(2), policy="prefix_affinity")
    server = ServerThread(app).start()
    try:
        gateway = app.state.gateway
        incremental = gateway.pipeline.blocks.incremental
        # the second turn's ~2k-token tail goes ahead (a default threshold would keep it inline)
        incremental.ahead_tokens = 256 if ahead else 10**9
        answers = [chat(server.url, FIRST)]
        tokenizer = HeldTokenizer(incremental.tokenizer)
        incremental.tokenizer = tokenizer
        tokenizer.release.set()
        if ahead:
            tokenizer.release.clear()
        second = second_turn("Done.")
        answers.append(chat(server.url, second))
        if ahead:  # answered while its tail's encoding is still held
            # the encoding starts in a worker thread beside the request, which may answer first
            assert tokenizer.started.wait(5) and not tokenizer.release.is_set()
            tokenizer.release.set()
        local = wait_until(lambda: gateway.locals.get(answers[0].headers["x-prefixgate-session"]))
        memo = wait_until(
            lambda: local.main.prompt if local.main.landing is None and local.main.prompt else None,
            "the second turn never landed",
        )
        index = gateway.router.index
        wait_until(
            lambda: max(index.match(memo.hashes).values(), default=0) == len(memo.hashes),
            "the second turn's blocks never reached the index",
        )
        answers.append(chat(server.url, [*second, {"role": "assistant", "content": "Ok."}]))
        estimates = [int(a.headers["x-prefixgate-estimated-cached-tokens"]) for a in answers]
        return estimates, [a.headers["x-prefixgate-backend"] for a in answers], len(memo.hashes)
    finally:
        server.stop()


def test_a_returning_turn_is_forwarded_before_its_tail_is_tokenized(rank_servers: RankServers) -> None:
    ahead, ahead_ranks, blocks = three_turns(rank_servers, ahead=True)
    inline, inline_ranks, inline_blocks = three_turns(rank_servers, ahead=False)
    assert ahead == inline and blocks == inline_blocks
    assert len(set(ahead_ranks)) == 1 and len(set(inline_ranks)) == 1  # every turn at its home
    assert ahead[2] >= blocks * 16  # the third turn expects the whole second prompt
