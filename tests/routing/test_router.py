"""Router + policies over the prefix index: affinity, load bounds, failover, replicas sharing Redis."""

from __future__ import annotations

import math

import pytest

from proxy.context import Outcome
from proxy.ops.metrics import Metrics
from proxy.stages.route import Router
from proxy.state.redis.index import RedisPrefixIndex
from routing.index.memory import MemoryPrefixIndex
from routing.policies import make_policy
from tests.routing.conftest import RedisServer, chain, make_ctx, make_pool, observe, pick


def route(router: Router, session: str | None, hashes: list[bytes]) -> str:
    """Pick a rank and hold the request in flight (as the forwarder does); return the rank's name."""
    backend = pick(router, make_ctx(session, hashes))
    backend.in_flight += 1
    return backend.name


def route_one(router: Router, session: str | None, hashes: list[bytes]) -> str:
    """Pick a rank for a request that completes before the next one arrives."""
    name = route(router, session, hashes)
    finish_all(router)
    return name


def finish_all(router: Router) -> None:
    for b in router.fleet:
        b.in_flight = 0


def test_session_sticks_to_its_rank_across_turns() -> None:
    router = Router(make_pool(4), make_policy("prefix_affinity"))
    system = chain("sys", 20)
    history = list(system)
    first = None
    for turn in range(6):
        history += chain(f"turn{turn}", 7, history[-1])
        ctx = make_ctx("sess-1", history)
        backend = pick(router, ctx)
        first = first or backend.name
        assert backend.name == first
        if turn:  # everything but the new turn's blocks was recorded by earlier turns
            assert ctx.estimated_cached_tokens == (len(history) - 7) * 16
        observe(router, ctx, backend, ctx.estimated_cached_tokens)


def test_new_sessions_with_shared_prefix_spread_within_the_load_bound() -> None:
    pool = make_pool(4)
    router = Router(pool, make_policy("prefix_affinity", balance_factor=1.25))
    system = chain("sys", 40)
    placed: list[str] = []
    for i in range(16):  # a burst: nothing finishes while they arrive
        total = sum(b.in_flight for b in pool)
        bound = max(math.ceil(1.25 * (total + 1) / 4), 2)  # CHWBL's bound, floored at MIN_BOUND
        name = route(router, f"s{i}", system + chain(f"user{i}", 3, system[-1]))
        assert pool.get(name).in_flight <= bound  # type: ignore[union-attr]
        placed.append(name)
    # The first sessions join the rank holding the shared prefix, up to the bound...
    assert placed[0] == placed[1] != placed[2]
    # ...and the burst ends spread over the whole fleet.
    assert set(placed) == {"r0", "r1", "r2", "r3"}
    assert max(placed.count(n) for n in set(placed)) <= 5


def test_new_session_goes_where_its_shared_prefix_is_held() -> None:
    pool = make_pool(4)
    router = Router(pool, make_policy("prefix_affinity"))
    system = chain("sys", 40)
    home = route(router, "a", system + chain("ua", 3, system[-1]))
    finish_all(router)
    other = chain("other-sys", 40)
    route(router, "b", other)
    finish_all(router)
    assert route(router, "c", system + chain("uc", 5, system[-1])) == home


def test_sticky_rank_over_the_bound_and_queued_sends_the_turn_elsewhere() -> None:
    """Over CHWBL's bound with more prefill queued there than the session holds: it leaves. (Over
    the bound alone it stays: ``test_home.py``.)"""
    pool = make_pool(4)
    router = Router(pool, make_policy("prefix_affinity", balance_factor=1.25))
    hashes = chain("s", 10)
    home = route(router, "s", hashes)
    pool.get(home).in_flight = 6  # type: ignore[union-attr]
    router.queued_prefill[home] += 1_000
    moved = route(router, "s", hashes + chain("t2", 2, hashes[-1]))
    assert moved != home


def test_unhealthy_rank_moves_its_sessions_and_they_stay_moved() -> None:
    pool = make_pool(3)
    router = Router(pool, make_policy("prefix_affinity"))
    sessions = {f"s{i}": chain(f"s{i}", 8) for i in range(9)}
    homes = {}
    for key, hashes in sessions.items():
        homes[key] = route(router, key, hashes)
        finish_all(router)
    down = homes["s0"]
    pool.get(down).mark_down("test")  # type: ignore[union-attr]
    new_homes = {key: route_one(router, key, hashes) for key, hashes in sessions.items()}
    assert down not in new_homes.values()
    for key in sessions:
        if homes[key] != down:
            assert new_homes[key] == homes[key], "sessions on healthy ranks do not move"
    pool.get(down).mark_up()  # type: ignore[union-attr]
    again = {key: route_one(router, key, hashes) for key, hashes in sessions.items()}
    assert again == new_homes, "moved sessions stay where their cache now is"


def test_observe_trims_the_mirror_when_the_rank_hit_less_and_counts_both() -> None:
    metrics = Metrics()
    pool = make_pool(2)
    index = MemoryPrefixIndex()
    router = Router(pool, make_policy("prefix_affinity"), index, metrics=metrics)
    hashes = chain("p", 10)
    ctx = make_ctx("s", hashes)
    backend = pick(router, ctx)
    observe(router, ctx, backend, 0)
    ctx = make_ctx("s", hashes)
    backend = pick(router, ctx)
    assert ctx.estimated_cached_tokens == 10 * 16
    observe(router, ctx, backend, 4 * 16)  # the rank had lost blocks 4..9
    assert index.match(hashes) == {backend.name: 4}
    page = metrics.render().decode()
    assert f'prefixgate_predicted_cached_tokens_total{{backend="{backend.name}"}} 160.0' in page
    assert f'prefixgate_reported_cached_tokens_total{{backend="{backend.name}"}} 64.0' in page
    assert f'prefixgate_index_corrections_total{{backend="{backend.name}"}} 1.0' in page


def test_estimate_never_counts_the_last_prompt_token() -> None:
    router = Router(make_pool(1), make_policy("prefix_affinity"))
    hashes = chain("x", 4)
    pick(router, make_ctx("s", hashes, prompt_tokens=64))
    ctx = make_ctx("s", hashes, prompt_tokens=64)  # fully cached 64-token prompt: 48 tokens can hit
    pick(router, ctx)
    assert ctx.estimated_cached_tokens == 48


def test_queued_prefill_released_on_observe_and_on_retry() -> None:
    pool = make_pool(2)
    router = Router(pool, make_policy("least_loaded"))
    ctx = make_ctx("s", chain("q", 10), prompt_tokens=170)
    first = pick(router, ctx)
    assert router.queued_prefill[first.name] == 170
    second = pick(router, ctx, tried=[first.name])  # a retry elsewhere
    assert router.queued_prefill[first.name] == 0 and router.queued_prefill[second.name] == 170
    observe(router, ctx, second, None)
    assert router.queued_prefill == {"r0": 0, "r1": 0}


@pytest.mark.parametrize("policy", ["least_loaded", "session_hash", "round_robin", "prefix_affinity"])
def test_every_policy_degrades_without_blocks(policy: str) -> None:
    pool = make_pool(4)
    router = Router(pool, make_policy(policy))
    names = [route(router, f"s{i}", []) for i in range(8)]
    assert max(names.count(n) for n in set(names)) <= 3
    finish_all(router)
    if policy in ("session_hash", "prefix_affinity"):
        assert route(router, "s3", []) == names[3], "sticky by session key alone"


def test_session_hash_is_consistent_and_bounded() -> None:
    pool = make_pool(4)
    a = make_policy("session_hash")
    b = make_policy("session_hash")
    router_a, router_b = Router(pool, a), Router(pool, b)
    for i in range(20):
        name = route(router_a, f"k{i}", [])
        finish_all(router_a)
        assert route(router_b, f"k{i}", []) == name
        finish_all(router_b)
    for _ in range(40):
        route(router_a, "hot", [])
    assert max(b.in_flight for b in pool) <= math.ceil(1.25 * 40 / 4)


def test_two_replicas_sharing_redis_route_a_session_alike(redis_server: RedisServer) -> None:
    pools = [make_pool(4), make_pool(4)]  # each replica has its own view of in-flight load
    replicas = [
        Router(
            pool, make_policy("prefix_affinity"), RedisPrefixIndex(redis_server.url, model="m", block_size=16)
        )
        for pool in pools
    ]
    for pool in pools:  # replica 0's other traffic makes its least-loaded choice differ from replica 1's
        pool.get("r0").in_flight = 0  # type: ignore[union-attr]
    history = chain("sys", 30)
    chosen = []
    for turn in range(6):
        history = history + chain(f"t{turn}", 4, history[-1])
        replica = replicas[turn % 2]
        ctx = make_ctx("shared-session", history)
        backend = pick(replica, ctx)
        chosen.append(backend.name)
        observe(replica, ctx, backend, ctx.estimated_cached_tokens)
        # Redis writes are asynchronous (milliseconds); a session's next turn comes seconds later.
        replica.index.flush()  # type: ignore[attr-defined]
        if turn:
            assert ctx.estimated_cached_tokens == (len(history) - 4) * 16, (
                "the other replica's record is seen"
            )
    assert len(set(chosen)) == 1
    for r in replicas:
        r.index.close()  # type: ignore[attr-defined]


def test_redis_killed_mid_run_routing_continues(redis_server: RedisServer) -> None:
    metrics = Metrics()
    index = RedisPrefixIndex(
        redis_server.url,
        model="m",
        block_size=16,
        retry_interval=0.05,
        on_state=lambda up: metrics.index_redis_up.set(1 if up else 0),
    )
    router = Router(make_pool(4), make_policy("prefix_affinity"), index, metrics=metrics)
    histories = {f"s{i}": chain(f"s{i}", 10) for i in range(6)}
    homes: dict[str, str] = {}
    for step in range(12):
        if step == 4:
            redis_server.stop()
        if step == 8:
            redis_server.start()
            import time

            time.sleep(0.1)
        for key in histories:
            histories[key] = histories[key] + chain(f"{key}-{step}", 2, histories[key][-1])
            ctx = make_ctx(key, histories[key])
            backend = pick(router, ctx)
            homes.setdefault(key, backend.name)
            assert backend.name == homes[key], "stickiness survives Redis going away and coming back"
            if step:
                assert ctx.estimated_cached_tokens == (len(histories[key]) - 2) * 16
            observe(router, ctx, backend, ctx.estimated_cached_tokens)
        if 4 <= step < 8:
            assert index.up is False and "prefixgate_index_redis_up 0.0" in metrics.render().decode()
    assert index.up is True and index.resyncs == 1
    index.close()


def test_a_streams_queued_prefill_leaves_at_its_first_token_and_its_tokens_at_its_end() -> None:
    router = Router(make_pool(1), make_policy("least_loaded"))
    held = make_ctx("held", chain("h", 10), prompt_tokens=170)  # another request, still in prefill
    pick(router, held)
    ctx = make_ctx("s", chain("q", 10), prompt_tokens=170)
    rank = pick(router, ctx)
    assert router.queued_prefill["r0"] == 340 and router.inflight_tokens["r0"] == 340
    router.prefilled(ctx)
    assert router.queued_prefill["r0"] == 170 and router.inflight_tokens["r0"] == 340
    router.prefilled(ctx)  # told twice: released once
    assert router.queued_prefill["r0"] == 170
    observe(router, ctx, rank, None)
    assert router.queued_prefill["r0"] == 170 and router.inflight_tokens["r0"] == 170
    observe(router, ctx, rank, None)  # a second end releases nothing either
    assert router.queued_prefill["r0"] == 170 and router.inflight_tokens["r0"] == 170


def test_a_whole_answer_keeps_its_prefill_queued_until_it_ends() -> None:
    router = Router(make_pool(1), make_policy("least_loaded"))
    ctx = make_ctx("s", chain("q", 10), prompt_tokens=170)
    rank = pick(router, ctx)
    assert router.queued_prefill["r0"] == 170
    observe(router, ctx, rank, None)
    assert router.queued_prefill["r0"] == 0 and router.inflight_tokens["r0"] == 0


def test_a_retry_charges_the_new_rank_whose_first_token_releases_it_once() -> None:
    router = Router(make_pool(2), make_policy("least_loaded"))
    ctx = make_ctx("s", chain("q", 10), prompt_tokens=170)
    first = pick(router, ctx)
    second = pick(router, ctx, tried=[first.name])  # the first rank failed before its first chunk
    holder = make_ctx("other", chain("o", 10), prompt_tokens=170)
    assert pick(router, holder).name == first.name  # least loaded: the rank the retry left
    router.prefilled(ctx)
    assert router.queued_prefill == {first.name: 170, second.name: 0}
    assert router.inflight_tokens == {first.name: 170, second.name: 170}
    router.finished(Outcome(ctx, second.name, 200, None, error="the stream broke"))
    assert router.queued_prefill == {first.name: 170, second.name: 0}
    assert router.inflight_tokens == {first.name: 170, second.name: 0}


def test_a_request_no_rank_answered_releases_its_whole_charge_once() -> None:
    router = Router(make_pool(2), make_policy("least_loaded"))
    for i in range(2):  # one other request in prefill on each rank
        pick(router, make_ctx(f"other{i}", chain(f"o{i}", 10), prompt_tokens=170))
    assert router.queued_prefill == {"r0": 170, "r1": 170}
    ctx = make_ctx("s", chain("q", 10), prompt_tokens=170)
    first = pick(router, ctx)
    pick(router, ctx, tried=[first.name])
    router.finished(Outcome(ctx, None, 502, error="every rank failed"))
    router.finished(Outcome(ctx, None, 502, error="told again"))
    router.prefilled(ctx)  # a late first-token event changes nothing once released
    assert router.queued_prefill == {"r0": 170, "r1": 170}
    assert router.inflight_tokens == {"r0": 170, "r1": 170}
