"""Stage 4, render and hash blocks: the prompt as the rank's token blocks and their vLLM hashes.

The API gives the body the rank renders (``Api.prompt_view``: for agent APIs the chat body vLLM
converts their request into). Per session only what changed since the previous turn is tokenized
and hashed (``tokenization.prompt.IncrementalTokenizer``), starting from the previous turn's memo
kept on the session's local state. A request the tokenizer cannot render is not an error here: the
rank is the judge of its own input, and routing falls back to session and load.
"""

from __future__ import annotations

import logging

from proxy.context import RequestContext
from proxy.state.local import SessionLocals
from tokenization.backend_tokenizer import BackendTokenizeError
from tokenization.base import UnsupportedRequest
from tokenization.prompt import IncrementalTokenizer, PromptBlocks

log = logging.getLogger("prefixgate.blocks")


class Blocks:
    """Fills ``ctx.prompt`` and, with a tokenizer (None: the routing policy needs no blocks),
    ``ctx.prompt_blocks``, ``ctx.prompt_tokens`` and ``ctx.block_hashes``."""

    def __init__(self, incremental: IncrementalTokenizer | None, locals_: SessionLocals) -> None:
        self.incremental = incremental
        self.locals = locals_

    async def __call__(self, ctx: RequestContext) -> None:
        ctx.prompt = prompt = ctx.api.prompt_view(ctx.body)
        incremental = self.incremental
        if incremental is None or prompt is None:
            return
        local = ctx.local
        previous = local.prompt if local is not None else None
        try:
            if ctx.api.prompt_kind == "text":
                blocks = await incremental.completion_blocks(prompt, previous)
            else:
                blocks = await incremental.chat_blocks(prompt, previous)
        except UnsupportedRequest as exc:
            log.debug("cannot render the request into blocks: %s", exc)
            return
        except BackendTokenizeError as exc:
            log.warning("backend tokenizer failed, routing without blocks: %s", exc)
            return
        if local is not None:
            self.remember(ctx, blocks)
        ctx.prompt_blocks = blocks
        ctx.prompt_tokens = blocks.num_tokens
        ctx.block_hashes = blocks.block_hashes

    def remember(self, ctx: RequestContext, blocks: PromptBlocks) -> None:
        """Keep this turn as the session's base for its next one."""
        local = ctx.local
        assert local is not None
        local.prompt, local.prompt_bytes = blocks.memo, blocks.memo_bytes
        self.locals.charge(local)
