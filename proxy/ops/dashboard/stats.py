"""What the dashboard remembers between polls: hit counters, the hit-rate time series, turns per session.

All are fed by ``Recorder.finished`` (told by the pipeline's ending: one call per finished request,
on the event loop) and are bounded: the fleet window and the series are ring buffers, the turn log
lives on the sessions' local state with its bounds. Nothing here touches the session store, so
recording costs a few integer updates.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from proxy.context import Outcome
from proxy.state.local import SessionLocals

#: Seconds between two points of the hit-rate series.
SAMPLE_INTERVAL_S = 2.0
#: Points kept: an hour of traffic at one point every two seconds.
SERIES_POINTS = 1800
#: The fleet hit rate is computed over this many most recent requests, as vLLM's log line does.
HIT_RATE_WINDOW = 1000
#: Turns kept per session (the newest).
TURNS_PER_SESSION = 100


def hit_rate(queried: int, hits: int) -> float | None:
    """Hit tokens over prompt tokens; None before any prompt token."""
    return hits / queried if queried else None


def computed_per_100(queried: int, hits: int) -> float | None:
    """Prompt tokens the ranks computed (did not hit) per 100 sent; None before any."""
    return 100.0 * (queried - hits) / queried if queried else None


@dataclass(slots=True)
class HitCounter:
    """Prompt tokens sent and hit since start, counting only answers that reported ``cached_tokens``."""

    requests: int = 0
    queried: int = 0
    hits: int = 0

    def add(self, queried: int, hits: int) -> None:
        self.requests += 1
        self.queried += queried
        self.hits += hits

    @property
    def rate(self) -> float | None:
        return hit_rate(self.queried, self.hits)

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "prompt_tokens": self.queried, "hit_tokens": self.hits}


class HitRateWindow:
    """Hit tokens over queried tokens across the most recent ``size`` requests (vLLM's log line)."""

    def __init__(self, size: int = HIT_RATE_WINDOW) -> None:
        self._window: deque[tuple[int, int]] = deque(maxlen=size)
        self.queried = 0
        self.hits = 0

    def add(self, queried: int, hits: int) -> None:
        window = self._window
        if len(window) == window.maxlen:
            old_queried, old_hits = window[0]
            self.queried -= old_queried
            self.hits -= old_hits
        window.append((queried, hits))
        self.queried += queried
        self.hits += hits

    @property
    def rate(self) -> float:
        return self.hits / self.queried if self.queried else 0.0

    def __len__(self) -> int:
        return len(self._window)


class Point(NamedTuple):
    """One sample of the fleet's reuse."""

    time: float
    window_rate: float | None  # hit rate over the last 1,000 requests
    cumulative_rate: float | None  # since start
    interval_rate: float | None  # over the requests answered since the previous point
    computed_per_100: float | None  # prompt tokens computed per 100 sent, over the last 1,000 requests
    requests: int  # answered since start


class Series:
    """The hit-rate time series: at most one point per ``interval`` seconds, the newest ``size`` kept.

    Sampled lazily, when a request is answered or the dashboard polls, so an idle proxy runs no timer;
    a quiet stretch shows as a gap in time rather than as repeated points.
    """

    def __init__(self, interval: float = SAMPLE_INTERVAL_S, size: int = SERIES_POINTS) -> None:
        self.interval = interval
        self.points: deque[Point] = deque(maxlen=size)
        self._last_queried = 0
        self._last_hits = 0

    def due(self, now: float) -> bool:
        return not self.points or now - self.points[-1].time >= self.interval

    def sample(self, now: float, total: HitCounter, window_queried: int, window_hits: int) -> Point:
        """Append the point for ``now`` (whether or not one is due) and return it."""
        point = self.current(now, total, window_queried, window_hits)
        self.points.append(point)
        self._last_queried = total.queried
        self._last_hits = total.hits
        return point

    def current(self, now: float, total: HitCounter, window_queried: int, window_hits: int) -> Point:
        """The point ``sample`` would append now, without appending it."""
        queried = total.queried - self._last_queried
        hits = total.hits - self._last_hits
        return Point(
            now,
            hit_rate(window_queried, window_hits),
            total.rate,
            hit_rate(queried, hits),
            computed_per_100(window_queried, window_hits),
            total.requests,
        )


class Turn(NamedTuple):
    """One answered turn of a session."""

    turn: int  # 0-based, as the prefix-break explainer numbers them
    time: float
    rank: str
    prompt_tokens: int | None
    cached_tokens: int | None  # as the rank reported (None: it did not say)
    estimated_cached_tokens: int | None  # as prefixgate's index predicted
    completion_tokens: int | None


class TurnLog:
    """The newest turns of each session, kept on the session's local state (``proxy.state.local``):
    bounded by its owner's session count and bytes, and at most ``turns`` per session."""

    def __init__(self, locals_: SessionLocals, turns: int = TURNS_PER_SESSION) -> None:
        self.locals = locals_
        self.turns = turns

    def add(self, key: str, turn: Turn) -> None:
        local = self.locals.open(key)
        if local.turns.maxlen != self.turns:
            local.turns = deque(local.turns, maxlen=self.turns)
        local.turns.append(turn)
        self.locals.charge(local)

    def get(self, key: str) -> list[Turn]:
        local = self.locals.get(key)
        return list(local.turns) if local is not None else []

    def as_json(self, key: str) -> list[dict[str, Any]]:
        """The session's turns as the admin API and the dashboard show them."""
        return [turn._asdict() for turn in self.get(key)]

    def forget(self, key: str) -> None:
        local = self.locals.get(key)
        if local is not None:
            local.turns.clear()

    def __len__(self) -> int:
        return sum(1 for local in self.locals.values() if local.turns)


class Recorder:
    """Everything the dashboard counts, fed once per finished request."""

    def __init__(
        self,
        window: HitRateWindow | None = None,
        *,
        interval: float = SAMPLE_INTERVAL_S,
        points: int = SERIES_POINTS,
        turn_log: TurnLog | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        #: The fleet's hit rate over its last 1,000 answered requests (as vLLM's log line counts it).
        self.window = window if window is not None else HitRateWindow()
        self.total = HitCounter()
        self.per_rank: dict[str, HitCounter] = {}
        self.series = Series(interval, points)
        self.turns = turn_log if turn_log is not None else TurnLog(SessionLocals())
        self.clock = clock

    def finished(self, outcome: Outcome) -> None:
        """Count an answered request in the fleet window and everything ``observed`` counts."""
        if not outcome.answered or outcome.rank is None:
            return
        usage = outcome.usage
        if usage is not None and usage.cached_tokens is not None:
            self.window.add(usage.prompt_tokens, usage.cached_tokens)
        ctx = outcome.ctx
        session = ctx.admitted.session if ctx.admitted is not None else None
        self.observed(
            outcome.rank,
            usage.prompt_tokens if usage is not None else None,
            usage.cached_tokens if usage is not None else None,
            session=session.key if session is not None else None,
            # the explainer numbers a session's turns from 0; admission counts them from 1
            turn=session.turns - 1 if session is not None else None,
            estimated_cached_tokens=ctx.estimated_cached_tokens,
            completion_tokens=usage.completion_tokens if usage is not None else None,
        )

    def observed(
        self,
        rank: str,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        *,
        session: str | None = None,
        turn: int | None = None,
        estimated_cached_tokens: int | None = None,
        completion_tokens: int | None = None,
    ) -> None:
        """A rank answered: count its hits (when it reported them) and log the session's turn."""
        now = self.clock()
        if prompt_tokens is not None and cached_tokens is not None:
            self.total.add(prompt_tokens, cached_tokens)
            counter = self.per_rank.get(rank)
            if counter is None:
                counter = self.per_rank[rank] = HitCounter()
            counter.add(prompt_tokens, cached_tokens)
        if session is not None and turn is not None:
            self.turns.add(
                session,
                Turn(
                    turn, now, rank, prompt_tokens, cached_tokens, estimated_cached_tokens, completion_tokens
                ),
            )
        self.tick(now)

    def tick(self, now: float | None = None) -> None:
        """Take a point of the series if one is due."""
        now = self.clock() if now is None else now
        if self.series.due(now):
            self.series.sample(now, self.total, self.window.queried, self.window.hits)

    def points(self, since: float | None = None) -> list[Point]:
        """The stored points after ``since`` (all of them when None), taking one first if due."""
        self.tick()
        return [p for p in self.series.points if since is None or p.time > since]

    def live(self) -> Point:
        """The point for this instant (not stored): what the chart's last point shows between samples."""
        return self.series.current(self.clock(), self.total, self.window.queried, self.window.hits)
