"""A turn in admission's accounting: what the request weighs (its prompt tokens, its blocks and its
shared head), the turn counted on the session's record before the request runs, and the answer that
settles it (the undo when the request fails is ``proxy.context.Before``'s: nothing the rank answered
may keep counting against its budget)."""

from __future__ import annotations

from proxy.admission.config import BYTES_PER_TOKEN
from proxy.context import RequestContext
from proxy.stages.usage import Usage
from proxy.state.sessions import Session


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


def take_turn(
    ctx: RequestContext,
    session: Session,
    tokens: int,
    head_key: str | None,
    head_tokens: int,
    block_size: int,
) -> None:
    """``ctx`` is ``session``'s next turn: its context is now this prompt of ``tokens``."""
    session.head_key, session.head_tokens = head_key, head_tokens
    session.turns += 1
    session.context_tokens = tokens
    session.context_blocks = context_blocks(ctx, tokens, block_size)


def settle(session: Session, usage: Usage, block_size: int) -> int:
    """The rank answered with ``usage``: count it; the session's context is now the prompt and the
    answer (what the next turn re-sends, and what the rank holds). Returns the context's change."""
    cached = usage.cached_tokens or 0
    session.prompt_tokens_sent += usage.prompt_tokens
    session.hit_tokens_reported += cached
    session.prefill_tokens += usage.prompt_tokens - cached
    context = usage.prompt_tokens + usage.completion_tokens
    delta = context - session.context_tokens
    session.context_tokens = context
    session.context_blocks = -(-context // block_size)
    return delta
