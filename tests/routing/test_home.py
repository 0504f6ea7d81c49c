"""An admitted session stays on its rank (``home_backend``) unless the rank is down or truly saturated."""

from __future__ import annotations

import logging

import pytest

from proxy.context import Admitted
from proxy.ops.metrics import Metrics
from proxy.stages.route import Router
from routing.index import CPU, GPU
from routing.index.memory import MemoryPrefixIndex
from routing.policies import make_policy
from tests.routing.conftest import chain, make_ctx, make_pool, observe, pick

POOL = 100_000


def homed_turn(router: Router, session: str, hashes: list[bytes], home: str | None) -> str:
    """Route one turn of an admitted session (``home``) and hold it in flight; the chosen rank."""
    ctx = make_ctx(session, hashes)
    ctx.admitted = Admitted(home=home)
    backend = pick(router, ctx)
    backend.in_flight += 1
    return backend.name


def first_turn(router: Router, session: str, hashes: list[bytes]) -> str:
    ctx = make_ctx(session, hashes)
    backend = pick(router, ctx)
    observe(router, ctx, backend, 0)
    return backend.name


def test_a_busy_rank_keeps_its_admitted_sessions_past_the_load_bound() -> None:
    pool = make_pool(4, pool_tokens=POOL)
    router = Router(pool, make_policy("prefix_affinity"))
    history = chain("s", 100)
    home = first_turn(router, "s", history)
    pool.get(home).in_flight = 6  # type: ignore[union-attr]  # far over CHWBL's bound of 3
    history += chain("t2", 4, history[-1])
    assert homed_turn(router, "s", history, home) == home


def test_a_known_session_over_the_load_bound_leaves_only_for_a_rank_that_scores_better() -> None:
    """Not homed by admission (no admission, or its rank lost most of its blocks): over CHWBL's bound
    its rank still wins while what it holds there outweighs the prefill queued there; the bound's
    count of requests alone does not move it (each move recomputes its context elsewhere)."""
    pool = make_pool(2, pool_tokens=POOL)
    router = Router(pool, make_policy("prefix_affinity"))
    history = chain("s", 100)
    rank = first_turn(router, "s", history)
    other = next(b.name for b in pool if b.name != rank)
    pool.get(rank).in_flight = 6  # type: ignore[union-attr]  # far over CHWBL's bound of 4
    history += chain("t2", 4, history[-1])
    assert homed_turn(router, "s", history, None) == rank
    # far more prefill queued there than the 1,600 tokens it holds: it goes where it scores better
    router.queued_prefill[rank] = 20_000
    history += chain("t3", 4, history[-1])
    assert homed_turn(router, "s", history, None) == other


def test_a_home_whose_requests_in_flight_fill_its_pool_keeps_its_session() -> None:
    """Admission keeps a rank's sessions within its pool and un-homes them when its prefill queue is
    saturated; the router does not move a homed session for the KV its requests in flight hold."""
    pool = make_pool(2, pool_tokens=POOL)
    router = Router(pool, make_policy("prefix_affinity"))
    history = chain("s", 20)
    home = first_turn(router, "s", history)
    router.inflight_tokens[home] = POOL
    router.queued_prefill[home] = 50_000
    assert homed_turn(router, "s", history + chain("t2", 2, history[-1]), home) == home


def overloaded_home(tag: str, blocks: int, queued: int) -> tuple[Router, list[bytes], str, str]:
    """Two ranks of unknown pools: session ``tag`` (``blocks`` blocks) on its home, which has far more
    requests in flight than CHWBL's bound and ``queued`` prefill tokens queued."""
    pool = make_pool(2)
    router = Router(pool, make_policy("prefix_affinity"))
    history = chain(tag, blocks)
    home = first_turn(router, tag, history)
    pool.get(home).in_flight = 6  # type: ignore[union-attr]
    router.queued_prefill[home] = queued
    other = next(b.name for b in pool if b.name != home)
    return router, history + chain("t2", 2, history[-1]), home, other


def test_with_an_unknown_pool_an_overloaded_home_lets_a_session_go_where_it_scores_better() -> None:
    router, turn, home, other = overloaded_home("s", 20, 50_000)
    assert homed_turn(router, "s", turn, home) == other


def test_with_an_unknown_pool_an_overloaded_home_keeps_a_session_too_costly_to_recompute() -> None:
    # 64k tokens held on its rank, none elsewhere; less than twice that queued
    router, turn, home, _ = overloaded_home("long", 4000, 30_000)
    assert homed_turn(router, "long", turn, home) == home


def down_home_turn(session: str) -> tuple[str, str]:
    """Session ``session`` homed on one of two ranks, which goes down: its home and where its next
    turn went."""
    pool = make_pool(2, pool_tokens=POOL)
    router = Router(pool, make_policy("prefix_affinity"))
    history = chain(session, 10)
    home = first_turn(router, session, history)
    pool.get(home).mark_down("test")  # type: ignore[union-attr]
    ctx = make_ctx(session, history + chain("t2", 2, history[-1]))
    ctx.admitted = Admitted(home=home)
    return home, pick(router, ctx).name


def test_a_down_home_rank_sends_the_session_elsewhere_and_the_move_is_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="prefixgate.route"):
        home, moved = down_home_turn("s")
    assert moved != home
    assert f"session s turn -1 moved {home} -> {moved}: its rank is down" in caplog.text


def moves_when_home_goes_down(blocks: int, on_gpu: int) -> dict[str, float]:
    """A session's home, fed by KV events, holds the first ``blocks`` of its prompt's 10 blocks, the
    first ``on_gpu`` of them in its GPU pool and the rest offloaded to its CPU tier only; the home
    goes down and the session moves. ``prefixgate_session_moves_total`` by what its home held."""
    pool = make_pool(2, pool_tokens=POOL)
    metrics = Metrics()
    index = MemoryPrefixIndex()
    history = chain("s", 10)
    router = Router(pool, make_policy("prefix_affinity"), index, metrics=metrics, exact=("r0", "r1"))
    index.record("r0", history[:blocks], counted=True, medium=GPU)
    index.record("r0", history[on_gpu:blocks], counted=True, medium=CPU)  # offloaded ...
    index.remove("r0", history[on_gpu:blocks], counted=True, medium=GPU)  # ... then the GPU dropped them
    index.set_session_rank("s", "r0")
    pool.get("r0").mark_down("test")  # type: ignore[union-attr]
    ctx = make_ctx("s", history + chain("t2", 2, history[-1]))
    ctx.admitted = Admitted(home="r0")
    assert pick(router, ctx).name == "r1"
    return {
        held: metrics.registry.get_sample_value("prefixgate_session_moves_total", {"held": held}) or 0.0
        for held in ("gpu", "cpu", "none")
    }


def test_a_move_is_counted_by_what_the_rank_it_left_held() -> None:
    # its shared head still on the GPU, its own context offloaded: the move loses a reload
    assert moves_when_home_goes_down(10, 3) == {"gpu": 0.0, "cpu": 1.0, "none": 0.0}
    assert moves_when_home_goes_down(10, 0) == {"gpu": 0.0, "cpu": 1.0, "none": 0.0}
    assert moves_when_home_goes_down(10, 10) == {"gpu": 1.0, "cpu": 0.0, "none": 0.0}
    assert moves_when_home_goes_down(0, 0) == {"gpu": 0.0, "cpu": 0.0, "none": 1.0}


def test_prompt_tokens_in_flight_are_counted_until_the_answer() -> None:
    pool = make_pool(2, pool_tokens=POOL)
    router = Router(pool, make_policy("least_loaded"))
    ctx = make_ctx("s", chain("q", 10), prompt_tokens=170)
    first = pick(router, ctx)
    assert router.inflight_tokens[first.name] == 170
    second = pick(router, ctx, tried=[first.name])  # a retry elsewhere releases the first attempt
    assert router.inflight_tokens == {first.name: 0, second.name: 170}
    observe(router, ctx, second, None)
    assert router.inflight_tokens == {"r0": 0, "r1": 0}
