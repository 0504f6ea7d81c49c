"""How much of a trace can hit: the infinite-cache bound, the traces' own block reuse and its sources."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from bench.traces.sessions import TraceSession


class UnitCacheBound:
    """Infinite-cache bound over unit sequences: one rank, unlimited pool, requests in sent order.

    A request's hits are its longest prefix of units seen before in any request, in tokens, rounded
    down to whole KV blocks and leaving the last prompt token to compute (as vLLM does).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._seen: set[int] = set()
        self.prompt_tokens = 0
        self.hit_tokens = 0

    def add(self, units: Sequence[tuple[Hashable, int]]) -> tuple[int, int]:
        """Account one request; returns its (prompt tokens, hit tokens)."""
        chain = 0
        matched = 0
        total = 0
        hitting = True
        for unit, tokens in units:
            chain = hash((chain, unit))
            if hitting and chain in self._seen:
                matched += tokens
            else:
                hitting = False
                self._seen.add(chain)
            total += tokens
        hittable = (total - 1) // self.block_size * self.block_size
        hits = min(matched // self.block_size * self.block_size, hittable)
        self.prompt_tokens += total
        self.hit_tokens += hits
        return total, hits

    @property
    def hit_rate(self) -> float:
        """Hit tokens over prompt tokens of every request added so far."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def trace_block_reuse(sessions: Iterable[TraceSession]) -> float:
    """The traces' own reuse figure: blocks whose prefix was seen before, over all blocks."""
    seen: set[int] = set()
    total = reused = 0
    for session in sessions:
        for request in session.requests:
            chain = 0
            for key in request.blocks:
                chain = hash((chain, key))
                if chain in seen:
                    reused += 1
                else:
                    seen.add(chain)
                total += 1
    return reused / total if total else 0.0


def reuse_breakdown(sessions: Sequence[TraceSession]) -> dict[str, float]:
    """Where the traces' block reuse comes from, as fractions of all blocks (they add up to the reuse).

    Requests are taken in order of ``t_s`` (a clock common to all sessions, as Mooncake's): ``head``
    is reuse of the sessions' leading ``head_blocks`` (a prefix every rank holds after its first
    request, whatever the routing), ``same_session`` of blocks the session itself sent before (what
    sticky routing keeps), ``across_sessions`` of blocks only other sessions sent before (what only
    prefix-aware routing finds).
    """
    requests = sorted(
        ((r.t_s, n, s.key, s.head_blocks, r.blocks) for n, s in enumerate(sessions) for r in s.requests),
        key=lambda item: (item[0], item[1]),
    )
    seen: set[int] = set()
    own: dict[str, set[int]] = {}
    head = same = across = total = 0
    for _, _, key, head_blocks, blocks in requests:
        mine = own.setdefault(key, set())
        chain = 0
        for position, block in enumerate(blocks):
            chain = hash((chain, block))
            total += 1
            if position < head_blocks and chain in seen:
                head += 1
            elif chain in mine:
                same += 1
            elif chain in seen:
                across += 1
            seen.add(chain)
            mine.add(chain)
    if not total:
        return {"head": 0.0, "same_session": 0.0, "across_sessions": 0.0}
    return {"head": head / total, "same_session": same / total, "across_sessions": across / total}
