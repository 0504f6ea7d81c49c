"""What a request weighs in admission's accounting: its prompt tokens, its blocks and its shared head."""

from __future__ import annotations

from proxy.admission.config import BYTES_PER_TOKEN
from proxy.context import RequestContext

#: Labels of a prompt's first part when it is the system+tools segment sessions of one agent share.
HEAD_PARTS = frozenset({"system+tools", "system", "tools"})


def prompt_tokens(ctx: RequestContext) -> int:
    """The prompt's tokens; estimated from the body without a count (policies that need no blocks)."""
    if ctx.prompt_tokens is not None:
        return ctx.prompt_tokens
    return len(ctx.raw_body) // BYTES_PER_TOKEN


def head(ctx: RequestContext) -> tuple[str | None, int]:
    """The prompt's leading system+tools segment in full blocks: (key, tokens), or (None, 0).

    Sessions of one agent share it, and a rank caches its blocks once whatever its sessions."""
    blocks = ctx.prompt_blocks
    if blocks is None or not blocks.parts or blocks.parts[0][0] not in HEAD_PARTS:
        return None, 0
    full = min(blocks.parts[0][2] // blocks.block_size, len(blocks.block_hashes))
    if full == 0:
        return None, 0
    last = blocks.block_hashes[full - 1]
    # chained hashes: the last block's hash names the whole head (and its salt)
    return (last.hex() if isinstance(last, bytes) else str(last)), full * blocks.block_size


def context_blocks(ctx: RequestContext, tokens: int, block_size: int) -> int:
    """Blocks of a context of ``tokens``: the prompt's own hash count when it is this prompt."""
    if ctx.block_hashes and tokens == ctx.prompt_tokens:
        return len(ctx.block_hashes)
    return -(-tokens // block_size)
