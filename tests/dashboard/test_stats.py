"""The dashboard's counters, series and turn log, without a server."""

from __future__ import annotations

from proxy.ops.dashboard import HitRateWindow, Recorder, Series, Turn, TurnLog
from proxy.ops.dashboard.stats import HitCounter
from proxy.state.local import SessionLocals


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def recorder(clock: Clock, window: HitRateWindow | None = None, **kwargs) -> tuple[Recorder, HitRateWindow]:
    window = window or HitRateWindow(size=3)
    return Recorder(window, clock=clock, **kwargs), window


def answer(rec: Recorder, window: HitRateWindow, rank: str, prompt: int, cached: int | None, **kw) -> None:
    # as in the gateway: admission feeds the fleet window, then the recorder sees the same answer
    if cached is not None:
        window.add(prompt, cached)
    rec.observed(rank, prompt, cached, **kw)


def test_counts_only_answers_that_reported_hits_per_rank_and_in_total():
    clock = Clock()
    rec, window = recorder(clock)
    answer(rec, window, "r0", 100, 0)
    answer(rec, window, "r0", 200, 150)
    answer(rec, window, "r1", 300, None)  # the rank did not say: not a miss
    answer(rec, window, "r1", 400, 400)
    assert (rec.total.requests, rec.total.queried, rec.total.hits) == (3, 700, 550)
    assert rec.per_rank["r0"].rate == 150 / 300
    assert rec.per_rank["r1"].to_dict() == {"requests": 1, "prompt_tokens": 400, "hit_tokens": 400}
    assert HitCounter().rate is None


def test_series_takes_one_point_per_interval_with_window_cumulative_and_interval_rates():
    clock = Clock()
    rec, window = recorder(clock, interval=2.0)
    answer(rec, window, "r0", 100, 0)  # first answer: first point
    clock.now += 1
    answer(rec, window, "r0", 100, 100)  # not due yet
    assert len(rec.series.points) == 1
    clock.now += 1.5
    answer(rec, window, "r0", 100, 100)  # due: the second point
    answer(rec, window, "r0", 100, 100)  # the window holds 3 requests: the first miss has left it
    points = rec.points()
    assert len(points) == 2
    second = points[1]
    assert second.window_rate == second.cumulative_rate == 200 / 300
    assert second.interval_rate == 1.0  # the two answers since the first point both hit fully
    assert second.requests == 3
    live = rec.live()
    assert live.window_rate == 1.0 and live.computed_per_100 == 0.0
    assert live.cumulative_rate == 300 / 400 and live.requests == 4
    assert rec.points(since=points[0].time) == [second]


def test_points_ticks_when_due_even_without_traffic_and_the_ring_is_bounded():
    clock = Clock()
    rec, window = recorder(clock, interval=1.0, points=3)
    for _ in range(5):
        answer(rec, window, "r0", 10, 5)
        clock.now += 1
    assert len(rec.series.points) == 3
    before = rec.series.points[-1].time
    clock.now += 10
    assert rec.points()[-1].time == clock.now > before


def test_series_points_before_any_hit_report_have_no_rates():
    series = Series(interval=1.0)
    point = series.sample(5.0, HitCounter(), 0, 0)
    assert point.window_rate is None and point.cumulative_rate is None and point.computed_per_100 is None


def test_turn_log_keeps_the_newest_turns_of_the_most_recent_sessions():
    log = TurnLog(SessionLocals(max_sessions=2), turns=3)
    for n in range(5):
        log.add("a", Turn(n, float(n), "r0", 10, 5, 5, 1))
    log.add("b", Turn(0, 0.0, "r0", 10, 5, 5, 1))
    log.add("a", Turn(5, 5.0, "r0", 10, 5, 5, 1))  # "a" is now the most recent
    log.add("c", Turn(0, 0.0, "r1", 10, 5, 5, 1))  # drops "b", the least recently answered
    assert [t.turn for t in log.get("a")] == [3, 4, 5]
    assert log.get("b") == []
    assert len(log) == 2
    log.forget("a")
    assert log.get("a") == [] and len(log) == 1


def test_recorder_logs_turns_per_session():
    clock = Clock()
    rec, window = recorder(clock)
    answer(rec, window, "r0", 100, 0, session="s", turn=0, estimated_cached_tokens=0, completion_tokens=4)
    answer(rec, window, "r1", 120, 96, session="s", turn=1, estimated_cached_tokens=80, completion_tokens=4)
    answer(rec, window, "r1", 50, 0)  # no session: counted, not logged
    turns = rec.turns.get("s")
    assert [(t.turn, t.rank, t.prompt_tokens, t.cached_tokens, t.estimated_cached_tokens) for t in turns] == [
        (0, "r0", 100, 0, 0),
        (1, "r1", 120, 96, 80),
    ]
