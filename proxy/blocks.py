"""Stage 4, render and hash blocks: the prompt as the rank's token blocks and their vLLM hashes.

Pass-through until ``tokenization/`` is wired in: ``ctx.block_hashes`` stays empty, so routing
policies that need blocks fall back to session and load information.
"""

from __future__ import annotations

from proxy.context import RequestContext


async def compute_blocks(ctx: RequestContext) -> None:
    """Fill ``ctx.prompt_tokens`` and ``ctx.block_hashes``."""
    return None
