"""Stage 4, render and hash blocks: the prompt as the rank's token blocks and their vLLM hashes.

Per session, only what changed since the previous turn is tokenized and hashed
(``tokenization.prompt.IncrementalTokenizer``). A request the tokenizer cannot render is not an
error here: the rank is the judge of its own input, and routing falls back to session and load.
"""

from __future__ import annotations

import logging

from proxy.context import ApiKind, RequestContext
from tokenization.backend_tokenizer import BackendTokenizeError
from tokenization.base import UnsupportedRequest
from tokenization.prompt import IncrementalTokenizer

log = logging.getLogger("prefixgate.blocks")


class BlockStage:
    """Fills ``ctx.prompt_tokens``, ``ctx.block_hashes`` and ``ctx.prompt_blocks``; off when None."""

    def __init__(self, incremental: IncrementalTokenizer | None) -> None:
        self.incremental = incremental

    async def __call__(self, ctx: RequestContext) -> None:
        incremental = self.incremental
        if incremental is None:
            return
        try:
            if ctx.api is ApiKind.COMPLETIONS:
                blocks = await incremental.blocks_for_completion(ctx.session_key, ctx.body)
            else:  # chat, or an agent API whose body the pipeline converted to chat messages
                blocks = await incremental.blocks_for_chat(ctx.session_key, ctx.body)
        except UnsupportedRequest as exc:
            log.debug("cannot render the request into blocks: %s", exc)
            return
        except BackendTokenizeError as exc:
            log.warning("backend tokenizer failed, routing without blocks: %s", exc)
            return
        ctx.prompt_blocks = blocks
        ctx.prompt_tokens = blocks.num_tokens
        ctx.block_hashes = blocks.block_hashes
