"""The prefix-break explainer: where and why a session's prompt stopped extending its previous turn.

It keeps, on each thread of a session's local state (``proxy.state.local``), the previous turn: its block
hashes and tokens (shared with the blocks stage, not copied), its prompt body and the rank it went
to. The pipeline tells it of each request twice:

- ``routed``: the first block whose chained hash differs from the previous turn's is found by
  binary search (a chained hash equal at block k means blocks 0..k are equal). A divergence before
  the previous turn's last full block is a *break*, explained by ``classify.explain`` (which part
  changed). The request carries away what it should hit (``ctx.expectation``).
- ``finished``: when the rank reported fewer cached tokens than the prefix this turn shares with
  the previous one, the session either moved to another rank or its blocks were evicted.

Canonicalization runs before, so what is reported is the drift that remains. Breaks are counted in
``prefixgate_prefix_breaks_total{cause}`` and kept per session for ``GET /admin/sessions/{id}``:
this process's recent ones with the edited line's text, the stored ones (the session table, which
Redis keeps a day) with its positions and digests only, unless bodies may be logged.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from proxy.canonical import first_differing_part
from proxy.context import Expectation, Outcome, RequestContext
from proxy.explain.classify import classify, explain
from proxy.explain.records import EVICTED, MOVED, moved, rank_break, without_text
from proxy.explain.turns import Turn, divergence, extends, parts, parts_of
from proxy.ops.metrics import Metrics
from proxy.state.local import MAIN, SessionLocal, SessionLocals, ThreadLocal


class Explainer:
    """Detects and explains prefix breaks per session.

    ``on_break(session_key, record)`` is called for every break (e.g. the session table's
    ``add_break``).
    """

    def __init__(
        self,
        locals_: SessionLocals,
        metrics: Metrics | None = None,
        *,
        on_break: Callable[[str, dict[str, Any]], object] | None = None,
        keep_text: bool = False,
    ) -> None:
        """``keep_text``: records given to ``on_break`` (stored, possibly shared through Redis) keep
        the edited prompt text; only when request bodies may be logged (``--log-bodies``)."""
        self.locals = locals_
        self.metrics = metrics
        self.on_break = on_break
        self.keep_text = keep_text

    def breaks(self, session_key: str) -> list[dict[str, Any]]:
        """The session's recorded breaks, oldest first; [] when this process holds none."""
        local = self.locals.get(session_key)
        return list(local.breaks) if local is not None else []

    def routed(self, ctx: RequestContext) -> None:
        """Compare the routed turn with the session's previous turn; then it becomes the previous turn."""
        local, thread = ctx.local, ctx.conversation
        if local is None or thread is None or ctx.prompt is None:
            return
        prev: Turn | None = thread.turn
        turn = turn_of(ctx, ctx.prompt, prev.number + 1 if prev is not None else 0)
        self._replace(local, thread, turn)
        if prev is None:
            return
        release_later(prev)
        blocks = ctx.prompt_blocks
        if blocks is not None and prev.tokens is not None and prev.block_size == blocks.block_size:
            common_blocks, offset = divergence(prev, turn)
            if common_blocks < len(prev.hashes):
                self._record(ctx, local, thread, explain(prev, turn, blocks, offset, common_blocks))
            hittable = max(turn.num_tokens - 1, 0) // turn.block_size
            expected = min(common_blocks, hittable) * turn.block_size
            ctx.expectation = Expectation(
                turn.number, expected, turn.num_tokens, turn.block_size, turn.rank, prev.rank
            )
        elif blocks is None and prev.tokens is None:
            # No blocks (policy without them, or an unrenderable body): compare by parts alone,
            # after a C-level deep comparison has shown the new body does not simply extend the old.
            found = None if extends(prev, turn) else first_differing_part(parts_of(prev), parts(turn))
            if found is not None:
                self._record(ctx, local, thread, classify(prev, turn, found, None, None, None))
            elif prev.rank is not None and turn.rank != prev.rank:
                self._record(ctx, local, thread, moved(prev, turn, None, None))
        self._charge(local, thread, turn)

    def finished(self, outcome: Outcome) -> None:
        """The rank answered (with ``cached_tokens``, or without saying): a rank-side break?

        When the rank counted the prompt differently from prefixgate, the tokenizer is not the
        rank's and block offsets cannot be compared, so nothing is judged.
        """
        ctx = outcome.ctx
        expected = ctx.expectation
        local, thread = ctx.local, ctx.conversation
        if expected is None or local is None or thread is None or not outcome.answered:
            return
        if self.locals.get(local.key) is not local:
            return  # the session's state was evicted (or ended) meanwhile
        usage = outcome.usage
        if usage is not None and usage.prompt_tokens != expected.num_tokens:
            return
        was_moved = expected.previous_rank is not None and expected.rank != expected.previous_rank
        cached = usage.cached_tokens if usage is not None else None
        if cached is None:
            if was_moved:
                self._record(ctx, local, thread, rank_break(expected, None, MOVED))
            return
        if cached < expected.expected_tokens:
            self._record(ctx, local, thread, rank_break(expected, cached, MOVED if was_moved else EVICTED))

    def _replace(self, local: SessionLocal, thread: ThreadLocal, turn: Turn) -> None:
        thread.turn = turn
        self._charge(local, thread, turn)

    def _charge(self, local: SessionLocal, thread: ThreadLocal, turn: Turn) -> None:
        thread.turn_bytes = turn.nbytes
        self.locals.charge(local)

    def _record(
        self, ctx: RequestContext, local: SessionLocal, thread: ThreadLocal, record: dict[str, Any]
    ) -> None:
        """A break of ``thread``: records of threads other than the main one name theirs, and every
        record's ``turn`` is the session's (as the dashboard's turn log numbers them), the thread's
        own in ``thread_turn`` where they differ."""
        if thread.key != MAIN:
            record["thread"] = thread.key
        session = ctx.admitted.session if ctx.admitted is not None else None
        if session is not None and session.turns - 1 != record.get("turn"):
            record["thread_turn"], record["turn"] = record.get("turn"), session.turns - 1
        thread.breaks += 1
        local.breaks.append(record)
        if self.metrics is not None:
            self.metrics.prefix_breaks.labels(record["cause"]).inc()
        if self.on_break is not None:
            self.on_break(local.key, record if self.keep_text else without_text(record))


def release_later(turn: Turn) -> None:
    """Let the replaced ``turn`` go at the loop's next turn, after this request's answer is sent.

    It holds the previous turn's parsed body and block hashes, thousands of objects for a long
    conversation (freeing a 100k-token turn's takes ~0.2 ms), and this is their last reference:
    dropped here, that was paid on the way to the rank's answer.
    """
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # called outside a loop: nothing waits on this caller
        return
    loop.call_soon(_drop, turn)


def _drop(_: object) -> None:
    """Nothing: the loop's handle held the reference, and lets it go once this has run."""


def turn_of(ctx: RequestContext, body: dict[str, Any], number: int) -> Turn:
    """The routed request as the session's next previous turn (its ``prompt`` body and blocks)."""
    blocks = ctx.prompt_blocks
    rank = ctx.rank.name if ctx.rank is not None else None
    # A parsed JSON body takes a few times its wire size in Python objects.
    nbytes = 3 * len(ctx.raw_body) + 256
    if blocks is None:
        return Turn(number, body, (), None, 0, 0, rank, nbytes)
    nbytes += len(blocks.tokens) * 4 + len(blocks.block_hashes) * 72
    return Turn(
        number,
        body,
        blocks.block_hashes,
        blocks.tokens,
        blocks.num_tokens,
        blocks.block_size,
        rank,
        nbytes,
    )
