"""Stage 4, render and hash blocks: the prompt as the rank's token blocks and their vLLM hashes.

The API gives the body the rank renders (``Api.prompt_view``: for agent APIs the chat body vLLM
converts their request into). Per session only what changed since the previous turn is tokenized
and hashed (``tokenization.prompt.IncrementalTokenizer``), starting from the previous turn's memo
kept on the thread's local state (``proxy.state.local``: each thread of a session has its own).
When this prompt extends the thread's previous one, the rank that answered it also cached the blocks
of its answer (vLLM caches decoded tokens' full blocks too): ``ctx.cached_answer`` says which of this
prompt's leading blocks that rank holds, for the router to count in the estimate. A request the
tokenizer cannot render is not an error here: the rank is the judge of its own input, and routing
falls back to session and load.

A first turn (no previous turn to start from) can match on the ranks only what other sessions left
there: essentially its head, the agent's system prompt and tools. When the rest of it is long
(``IncrementalTokenizer.first_chat_blocks``), the turn goes on with its head's blocks (encoded and
hashed once per agent) and a size estimated from its text, and the whole prompt is tokenized and
hashed beside it (``ctx.landing``): its memo, the index's record and what learns from answers use
the whole prompt once it lands, and the thread's next turn awaits it. A returning turn whose new
tail is worker-thread work (``returning_chat_blocks``) goes on the same way with the blocks it
keeps of its previous turn: its new tail is in no rank's cache, so routing loses nothing by not
waiting for it, and the request is on its way while a worker thread encodes it. A shorter tail goes
the same way but is encoded on the event loop (no thread hop), at the request's first wait: while
its rank works, not before the request is sent. The previous answer's blocks
(``ctx.cached_answer``) are known once the prompt lands, and the router's estimate of the whole
prompt then (``Router.landed``); a short tail lands before the answer starts (``settle``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Set as AbstractSet
from typing import Any

from proxy.context import RequestContext
from proxy.state.local import Answer, CachedAnswer, SessionLocals, ThreadLocal
from tokenization.backend_tokenizer import BackendTokenizeError
from tokenization.base import UnsupportedRequest
from tokenization.prompt import IncrementalTokenizer, PromptBlocks, PromptHead, PromptMemo

log = logging.getLogger("prefixgate.blocks")


class Blocks:
    """Fills ``ctx.prompt`` and, with a tokenizer (None: the routing policy needs no blocks),
    ``ctx.prompt_blocks``, ``ctx.prompt_tokens`` and ``ctx.block_hashes``."""

    def __init__(
        self,
        incremental: IncrementalTokenizer | None,
        locals_: SessionLocals,
        tails_on_loop: bool = True,
        exact_ranks: AbstractSet[str] = frozenset(),
    ) -> None:
        self.incremental = incremental
        self.locals = locals_
        #: Whether a returning turn's short tail may be encoded on the loop after it was routed: not
        #: with a shared index (its re-estimate would be one more round trip on the loop), nor while
        #: any rank is fed by KV events (``Router.landed`` could not estimate its whole prompt).
        self.tails_on_loop = tails_on_loop
        #: The ranks fed by KV events: the router's own set (``Router.exact``), read as it changes.
        self.exact_ranks = exact_ranks
        # The first turns' landings in flight: the event loop keeps only weak references to tasks.
        self._landing: set[asyncio.Task[None]] = set()

    async def __call__(self, ctx: RequestContext) -> None:
        ctx.prompt = prompt = ctx.api.prompt_view(ctx.body)
        incremental = self.incremental
        if incremental is None or prompt is None:
            return
        thread = ctx.conversation
        if thread is not None and thread.landing is not None:
            await asyncio.shield(thread.landing)  # the previous turn, this one's base, is landing
        # a memo is a base only for the tokenizer that made it (the fleet's may be replaced when a
        # rank tells more: ``proxy.fleet_tokenizer``)
        previous = thread.prompt if thread is not None and thread.prompt_by is incremental else None
        try:
            if ctx.api.prompt_kind == "text":
                blocks = await incremental.completion_blocks(prompt, previous)
            elif previous is None:
                first = await incremental.first_chat_blocks(prompt)
                if isinstance(first, PromptHead):
                    self._go_on_head(ctx, thread, first, incremental)
                    return
                blocks = first
            else:
                later = await incremental.returning_chat_blocks(
                    prompt, previous, on_loop=self.tails_on_loop and not self.exact_ranks
                )
                if isinstance(later, PromptHead):
                    self._go_on_head(ctx, thread, later, incremental, previous)
                    return
                blocks = later
        except UnsupportedRequest as exc:
            log.debug("cannot render the request into blocks: %s", exc)
            return
        except BackendTokenizeError as exc:
            log.warning("backend tokenizer failed, routing without blocks: %s", exc)
            return
        self._land(ctx, blocks, previous, prompt, incremental)

    def _land(
        self,
        ctx: RequestContext,
        blocks: PromptBlocks,
        previous: PromptMemo | None,
        prompt: dict[str, Any],
        made_by: IncrementalTokenizer,
    ) -> None:
        thread = ctx.conversation
        if thread is not None:
            ctx.cached_answer = answer_blocks(thread.answer, previous, blocks, prompt, thread.verbatim)
            self.remember(ctx, blocks, made_by)
        ctx.prompt_blocks = blocks
        ctx.prompt_tokens = blocks.num_tokens
        ctx.block_hashes = blocks.block_hashes

    def _go_on_head(
        self,
        ctx: RequestContext,
        thread: ThreadLocal | None,
        head: PromptHead,
        made_by: IncrementalTokenizer,
        previous: PromptMemo | None = None,
    ) -> None:
        """Route and admit a turn on its head (a first turn's, or the blocks a returning turn keeps of
        ``previous``) and estimated size; the rest lands beside it."""
        ctx.prompt_blocks = head.blocks
        ctx.prompt_tokens = head.estimated_tokens
        ctx.block_hashes = head.blocks.block_hashes
        task = asyncio.create_task(self._rest(ctx, head, made_by, previous))
        ctx.landing, ctx.landing_on_loop = task, head.on_loop
        if thread is not None:
            thread.landing = task
        self._landing.add(task)
        task.add_done_callback(self._landing.discard)

    @staticmethod
    async def settle(ctx: RequestContext) -> None:
        """A short tail encoded on the event loop (``ctx.landing_on_loop``) has landed before the
        answer starts: its headers carry the whole prompt's estimate. It ran at the request's first
        wait, so this waits only when the rank answered before the loop got to it."""
        if ctx.landing_on_loop and ctx.landing is not None and not ctx.landing.done():
            await asyncio.shield(ctx.landing)

    async def _rest(
        self,
        ctx: RequestContext,
        head: PromptHead,
        made_by: IncrementalTokenizer,
        previous: PromptMemo | None,
    ) -> None:
        """The whole prompt of a turn routed on its head, on its context and its thread's memo. Never
        raises: a prompt that cannot be rendered leaves the request without blocks, as on the path."""
        prompt = ctx.prompt
        assert prompt is not None
        try:
            if head.on_loop:
                # This task was queued before the request was sent; the task that writes the
                # request's body (aiohttp's) is queued when the request first waits. One turn of the
                # loop lets it go first, so the tail is encoded while the rank reads and computes.
                await asyncio.sleep(0)
            blocks = await head.rest()
        except Exception as exc:  # the request is on its way: whatever failed here must not lose it
            if isinstance(exc, (UnsupportedRequest, BackendTokenizeError)):
                log.warning("cannot render a turn routed on its head into blocks: %s", exc)
            else:
                log.exception("tokenizing a turn routed on its head failed")
            ctx.prompt_blocks, ctx.prompt_tokens, ctx.block_hashes = None, None, ()
        else:
            self._land(ctx, blocks, previous, prompt, made_by)
        finally:
            thread = ctx.conversation
            if thread is not None and thread.landing is ctx.landing:
                thread.landing = None

    def remember(self, ctx: RequestContext, blocks: PromptBlocks, made_by: IncrementalTokenizer) -> None:
        """Keep this turn as the session's base for its next one (``made_by``'s)."""
        thread, local = ctx.conversation, ctx.local
        assert thread is not None and local is not None
        thread.prompt, thread.prompt_bytes = blocks.memo, blocks.memo_bytes
        thread.prompt_by = made_by
        self.locals.charge(local)


#: Tokens a chat template may add after an assistant turn's content (``<|im_end|>`` and a newline).
MAX_END_OF_TURN_TOKENS = 4


def answer_blocks(
    answer: Answer | None,
    previous: PromptMemo | None,
    blocks: PromptBlocks,
    prompt: dict[str, Any],
    verbatim: dict[str, bool],
) -> CachedAnswer | None:
    """The rank and this prompt's leading blocks it holds when this prompt carries the previous
    answer right after the previous prompt; None otherwise. Counted (``credited``) unless the
    thread's answers of that kind proved to come back rewritten (``verbatim``).

    vLLM caches the full blocks of every computed token: the prompt's and the answer's but its last
    sampled one (never fed back), so ``prompt + completion - 1`` tokens. They lead this prompt when
    it extends the previous prompt (its full blocks' chained hash is there) with an assistant turn
    that starts where the previous generation prompt did and is as long as that prompt, the answer
    and a template's end of turn: the agent sent the answer back as it was generated.
    """
    if answer is None or previous is None or previous.kind != "chat":
        return None
    encoded = previous.encoded
    if not encoded.parts or encoded.parts[-1][0] != "generation_prompt" or answer.completion_tokens < 1:
        return None
    known = len(previous.hashes)
    hashes = blocks.block_hashes
    if known and (len(hashes) < known or hashes[known - 1] != previous.hashes[known - 1]):
        return None
    _, start, end = encoded.parts[-1]
    turn = next((p for p in blocks.parts if p[1] == start), None)
    if turn is None or blocks.tokens[start:end] != encoded.tokens[start:end]:
        return None
    extra = (turn[2] - turn[1]) - (end - start) - answer.completion_tokens
    if not 0 <= extra <= MAX_END_OF_TURN_TOKENS:
        return None
    held = min((answer.prompt_tokens + answer.completion_tokens - 1) // blocks.block_size, len(hashes))
    if held <= known:
        return None
    kind = "tools" if _calls_tools(prompt, turn[0]) else "text"
    return CachedAnswer(answer.rank, held, kind, verbatim.get(kind, True))


def _calls_tools(prompt: dict[str, Any], label: str) -> bool:
    """Whether the message of part ``label`` (``message[i]``) calls tools."""
    messages = prompt.get("messages")
    if not (label.startswith("message[") and label.endswith("]") and isinstance(messages, list)):
        return False
    index = label[len("message[") : -1]
    message = messages[int(index)] if index.isdigit() and int(index) < len(messages) else None
    return isinstance(message, dict) and bool(message.get("tool_calls"))
