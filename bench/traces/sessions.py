"""A trace as the replay sees it: sessions of requests, each request a sequence of block ids."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from bench.traces.blocks import BlockKey


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: its blocks, output length and the client's wait before sending it."""

    blocks: tuple[BlockKey, ...]
    input_tokens: int
    output_tokens: int
    think_time_s: float = 0.0
    t_s: float = 0.0


@dataclass
class TraceSession:
    """One conversation of a trace, replayed in order; ``children`` run as sessions of their own.

    ``children`` maps a request index to the sub-agent sessions the parent starts (and waits for)
    before sending that request. ``head_blocks`` leading blocks form the system message.
    """

    key: str
    requests: list[TraceRequest]
    head_blocks: int = 0
    start_s: float = 0.0
    children: dict[int, list[TraceSession]] = field(default_factory=dict)

    def all_sessions(self) -> Iterator[TraceSession]:
        """This session, then its sub-agents' sessions (depth first)."""
        yield self
        for subs in self.children.values():
            for sub in subs:
                yield from sub.all_sessions()

    def first_requests(self, count: int) -> TraceSession:
        """A copy holding this session's first ``count`` requests, and the sub-agents started before
        them (each cut the same way); it starts at the trace's time 0. The trace is left as it is."""
        children = {
            index: [sub.first_requests(count) for sub in subs]
            for index, subs in self.children.items()
            if index < count
        }
        return TraceSession(self.key, self.requests[:count], self.head_blocks, 0.0, children)

    @property
    def max_input_tokens(self) -> int:
        """The longest request of this session (its sub-agents not included)."""
        return max((r.input_tokens for r in self.requests), default=0)
