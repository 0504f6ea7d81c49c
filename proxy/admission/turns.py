"""A session's record as its turns come and go: the turn admission counts before the request runs,
the answer that settles it, and the undo when the request fails (nothing the rank answered may keep
counting against its budget)."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.admission.weight import context_blocks
from proxy.context import RequestContext
from proxy.stages.usage import Usage
from proxy.state.sessions import Session


@dataclass(frozen=True, slots=True)
class Before:
    """What admission changes of a session's record for one request, as it stood before."""

    turns: int
    context_tokens: int
    context_blocks: int
    head_key: str | None
    head_tokens: int
    last_seen: float
    answered_at: float
    rank: str | None
    released: bool

    @classmethod
    def of(cls, session: Session) -> Before:
        return cls(
            session.turns,
            session.context_tokens,
            session.context_blocks,
            session.head_key,
            session.head_tokens,
            session.last_seen,
            session.answered_at,
            session.rank,
            session.released,
        )

    def restore_turn(self, session: Session) -> None:
        """The request failed: its turn and its growth no longer count; the session stays where it
        was, with nothing in flight."""
        session.turns = self.turns
        session.context_tokens, session.context_blocks = self.context_tokens, self.context_blocks
        session.head_key, session.head_tokens = self.head_key, self.head_tokens
        session.answered_at = session.last_seen

    def restore_all(self, session: Session) -> None:
        """A session admitted anew by a request that failed: back to how it had ended."""
        self.restore_turn(session)
        session.last_seen, session.answered_at = self.last_seen, self.answered_at
        session.rank, session.released = self.rank, self.released


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
