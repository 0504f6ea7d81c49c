"""The per-cell figures of a replay that read its turns one by one: decode throughput, TTFT of first
and returning turns apart, and how long requests waited before a rank ran them.

- Generated tokens/s: the tokens the ranks generated (their ``usage.completion_tokens``) over the
  cell's wall time, so a system that makes its ranks recompute prompts, or keeps requests waiting,
  generates less per second.
- TTFT of first turns (a session's request 0: nothing of it can be cached but a shared head) and of
  returning turns (the rest: what a kept prefix speeds up), apart, since they answer different
  questions: whether newcomers wait, and whether the pool kept what it had.
- Seat wait: the client's send (first attempt) to the rank receiving the request: how long the
  system in front held it (an admission queue, 429s and their retries). A router that forwards at
  once holds nothing; a queue for one of the rank's own seats (vLLM's ``max-num-seqs``) is the rank
  queue, measured apart: the rank's receipt to its first scheduling. Both come from the simulated
  ranks' ``sim_timing`` (the same machine's wall clock), so they are measured the same way for
  every system, prefixgate or peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from bench.common import median, percentile


class TimedTurn(Protocol):
    """What these figures read of a turn (``bench.replay.TurnResult`` has it)."""

    @property
    def turn(self) -> int: ...
    @property
    def ttft_s(self) -> float: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def held_s(self) -> float | None: ...
    @property
    def rank_queue_s(self) -> float | None: ...


def _ms(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile in milliseconds; None without values (no such turn in the cell)."""
    if not values:
        return None
    return (median(values) if q == 50 else percentile(values, q)) * 1000


def turn_figures(turns: Sequence[TimedTurn], wall_s: float) -> dict[str, Any]:
    """Generated tokens and tokens/s over ``wall_s``, TTFT p50/p99 of first and returning turns,
    p99 seat wait and rank queue (ms; None when no turn has them)."""
    generated = sum(t.completion_tokens for t in turns)
    first = [t.ttft_s for t in turns if t.turn == 0]
    returning = [t.ttft_s for t in turns if t.turn > 0]
    held = [t.held_s for t in turns if t.held_s is not None]
    queued = [t.rank_queue_s for t in turns if t.rank_queue_s is not None]
    return {
        "generated_tokens": generated,
        "generated_tok_s": generated / wall_s if wall_s > 0 else 0.0,
        "ttft_first_p50_ms": _ms(first, 50),
        "ttft_first_p99_ms": _ms(first, 99),
        "ttft_returning_p50_ms": _ms(returning, 50),
        "ttft_returning_p99_ms": _ms(returning, 99),
        "seat_wait_p99_ms": _ms(held, 99),
        "rank_queue_p99_ms": _ms(queued, 99),
    }
