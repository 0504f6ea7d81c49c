"""What a request weighs in admission's accounting: its prompt tokens, its blocks and its shared head."""

from __future__ import annotations

from proxy.admission.config import BYTES_PER_TOKEN
from proxy.context import RequestContext


def prompt_tokens(ctx: RequestContext) -> int:
    """The prompt's tokens; estimated from the body without a count (policies that need no blocks)."""
    if ctx.prompt_tokens is not None:
        return ctx.prompt_tokens
    return len(ctx.raw_body) // BYTES_PER_TOKEN


def head(ctx: RequestContext) -> tuple[str | None, int]:
    """The prompt's head (``PromptBlocks.head``: the system+tools segment sessions of one agent
    share, which a rank caches once whatever its sessions), or (None, 0)."""
    blocks = ctx.prompt_blocks
    return blocks.head() if blocks is not None else (None, 0)


def context_blocks(ctx: RequestContext, tokens: int, block_size: int) -> int:
    """Blocks of a context of ``tokens``: the prompt's own hash count when it is this prompt."""
    if ctx.block_hashes and tokens == ctx.prompt_tokens:
        return len(ctx.block_hashes)
    return -(-tokens // block_size)
