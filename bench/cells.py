"""The cells of a ``prefixgate bench`` preset with fleets: a fleet x a traffic shape x a pressure.

Fleets (``FLEETS``):

- ``seed``: one rank like the seed deployment's: a 181,777-token KV pool in 256-token blocks and 8
  seats (vLLM's ``--max-num-seqs 8``: at most 8 sequences run at once, the rest queue in the rank).
  The pool is fixed, so a pressure is set by how many sessions run at once.
- ``several``: the preset's ``ranks`` ranks as the ``matrix`` preset runs them (16-token blocks,
  vLLM's 256 seats). How many sessions run at once is fixed (the preset's ``over_concurrency``), so
  a pressure is set by the size of each rank's pool (``bench.pressure.pool_for``).

Shapes (``SHAPES``):

- ``whole``: whole conversations arriving over time (the ``matrix`` preset's traffic): ``n`` run
  at once, and as many again wait, each starting when one ends. Only conversations of at most
  ``whole_turns`` requests are taken (uncut), so that a cell's longest chain of turns, and its wall
  time, stays short.
- ``sessions``: ``n`` sessions starting together, each cut to its first ``session_turns`` requests
  (about 40): they start at once and end.

In both fleets a pressure means the same: the replay's mean working set (``bench.pressure``: the
latest prompt of every active session, answers taken as instant) over the fleet's total pools.
On the seed fleet ``n`` is the count whose working set comes closest to the pressure aimed at; the
cell reports the pressure planned and the one the run measured.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.pressure import mean_working_set, pool_for
from bench.sim import DEFAULT_KV_TOKENS
from bench.traces import TraceSession


@dataclass(frozen=True, slots=True)
class Fleet:
    """A fleet kind: ``ranks`` and ``kv_tokens`` None take the preset's ranks and a pool sized for
    the pressure."""

    ranks: int | None
    kv_tokens: int | None
    block_size: int
    max_num_seqs: int


#: vLLM's ``--max-num-seqs`` default on an H100: seats enough that a pool, not seats, binds.
VLLM_SEATS = 256

FLEETS: dict[str, Fleet] = {
    "seed": Fleet(ranks=1, kv_tokens=DEFAULT_KV_TOKENS, block_size=256, max_num_seqs=8),
    "several": Fleet(ranks=None, kv_tokens=None, block_size=16, max_num_seqs=VLLM_SEATS),
}
SHAPES: tuple[str, ...] = ("whole", "sessions")


@dataclass(frozen=True, slots=True)
class CellPlan:
    """What one cell replays, and in front of what."""

    sessions: list[TraceSession]
    #: Sessions (conversations) running at once.
    concurrency: int
    ranks: int
    kv_tokens: int
    block_size: int
    max_num_seqs: int
    #: The mean working set over the fleet's pools, as planned (before any system ran).
    pressure_planned: float


def shaped(
    shape: str, candidates: Sequence[TraceSession], count: int, session_turns: int
) -> tuple[list[TraceSession], int]:
    """The sessions a shape replays with ``count`` at once, and its concurrency (``candidates`` of
    the whole shape: already those short enough, see ``whole_candidates``)."""
    if shape == "sessions":
        chosen = [session.first_requests(session_turns) for session in candidates[:count]]
        return chosen, len(chosen)
    if shape == "whole":
        return list(candidates[: 2 * count]), count
    raise ValueError(f"unknown shape {shape!r}: {', '.join(SHAPES)}")


def whole_candidates(candidates: Sequence[TraceSession], whole_turns: int | None) -> list[TraceSession]:
    """The conversations the whole shape may take: those of at most ``whole_turns`` requests (each of
    its sessions, sub-agents included), in order; every one without a bound."""
    if whole_turns is None:
        return list(candidates)
    return [c for c in candidates if all(len(s.requests) <= whole_turns for s in c.all_sessions())]


def _closest(counts: range, pressure_of: Callable[[int], float], pressure: float) -> int:
    """The count whose pressure is closest to ``pressure`` (the smaller one on a tie)."""
    return min(counts, key=lambda n: (abs(pressure_of(n) / pressure - 1.0), n))


def plan_cell(
    fleet_name: str,
    shape: str,
    pressure: float,
    candidates: Sequence[TraceSession],
    *,
    ranks: int,
    concurrency: int,
    session_turns: int,
    time_scale: float,
    whole_turns: int | None = None,
) -> CellPlan:
    """The sessions, concurrency and fleet of one cell (see the module docstring); ``ranks`` and
    ``concurrency`` are the preset's, for the ``several`` fleet."""
    fleet = FLEETS[fleet_name]
    if shape == "whole":
        candidates = whole_candidates(candidates, whole_turns)
    if fleet.kv_tokens is not None:  # the pool is fixed: pressure is how many run at once
        pool = fleet.kv_tokens * (fleet.ranks or ranks)
        most = len(candidates) if shape == "sessions" else max(1, len(candidates) // 2)

        def pressure_of(n: int) -> float:
            return mean_working_set(*shaped(shape, candidates, n, session_turns), time_scale) / pool

        count = _closest(range(1, most + 1), pressure_of, pressure)
        sessions, running = shaped(shape, candidates, count, session_turns)
        return CellPlan(
            sessions,
            running,
            fleet.ranks or ranks,
            fleet.kv_tokens,
            fleet.block_size,
            fleet.max_num_seqs,
            pressure_of(count),
        )
    sessions, running = shaped(shape, candidates, concurrency, session_turns)
    working_set = mean_working_set(sessions, running, time_scale)
    fleet_ranks = fleet.ranks or ranks
    kv_tokens = pool_for(working_set, pressure, fleet_ranks, fleet.block_size)
    return CellPlan(
        sessions,
        running,
        fleet_ranks,
        kv_tokens,
        fleet.block_size,
        fleet.max_num_seqs,
        working_set / (kv_tokens * fleet_ranks),
    )
