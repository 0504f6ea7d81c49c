"""prefix_affinity weighs the prefill queued on each rank against what the shared head saves there:
a wave of first turns spreads once the head's rank has more queued than the head saves, returning
sessions stay home. Policy-level, router-level (the head and the ranks' speeds reach the policy) and
properties of the shared math (``bounds.placement_score``, ``bounds.token_weights``)."""

from __future__ import annotations

from array import array

from hypothesis import given
from hypothesis import strategies as st

from proxy.context import Admitted, RequestContext
from proxy.stages.route import Router
from routing.policies import RouteRequest, make_policy
from routing.policies.bounds import placement_score, token_weights
from routing.ranks import Rank
from tests.routing.conftest import chain, make_ctx, make_pool, pick
from tokenization.prompt import PromptBlocks

BLOCK = 16
HEAD_BLOCKS = 960  # a 15,360-token system prompt and tools, as Claude Code's
HEAD = HEAD_BLOCKS * BLOCK
HEAD_CHAIN = chain("agent-head", HEAD_BLOCKS)


def two_ranks(*in_flight: int) -> list[Rank]:
    return [Rank(f"r{i}", "http://127.0.0.1:1", in_flight=n) for i, n in enumerate(in_flight)]


def first_turn(session: str, rest_blocks: int, **fields: object) -> RouteRequest:
    """A session's first turn: the agent's head, then ``rest_blocks`` of its own (+5 tokens)."""
    hashes = HEAD_CHAIN + chain(session, rest_blocks, HEAD_CHAIN[-1])
    request = RouteRequest(session, len(hashes) * BLOCK + 5, hashes, head_tokens=HEAD)
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def first(policy_name: str, request: RouteRequest, candidates: list[Rank]) -> str:
    return make_policy(policy_name).order(request, candidates)[0].name


def test_a_first_turn_leaves_the_heads_rank_once_its_queue_costs_more_than_the_head_saves() -> None:
    fleet = two_ranks(1, 1)
    for rest in (40, 2800):  # 640 and 44,800 tokens past the head: the rule is the same for both
        below = first_turn("s", rest, matched_blocks={"r0": HEAD_BLOCKS}, queued_prefill={"r0": HEAD - 1024})
        assert first("prefix_affinity", below, fleet) == "r0"
        over = first_turn("s", rest, matched_blocks={"r0": HEAD_BLOCKS}, queued_prefill={"r0": HEAD + 1024})
        assert first("prefix_affinity", over, fleet) == "r1"
        # the prefill queued on the idle rank counts alike: what matters is the difference
        over.queued_prefill = {"r0": HEAD + 1024, "r1": 2048}
        assert first("prefix_affinity", over, fleet) == "r0"


def test_a_sessions_own_blocks_still_count_twice_against_the_queue() -> None:
    fleet = two_ranks(1, 1)
    # r0 holds the head and 2,000 blocks (32k tokens) of the session's own: it stays there with up to
    # head + 2 x 32k tokens queued, well past what the head alone would hold it for
    request = first_turn(
        "s", 2400, matched_blocks={"r0": HEAD_BLOCKS + 2000}, queued_prefill={"r0": HEAD + 60_000}
    )
    assert first("prefix_affinity", request, fleet) == "r0"
    request.queued_prefill = {"r0": HEAD + 66_000}
    assert first("prefix_affinity", request, fleet) == "r1"


def test_returning_sessions_stay_home_whatever_is_queued_there() -> None:
    fleet = [Rank(f"r{i}", "http://127.0.0.1:1", pool_tokens=1_000_000, in_flight=1) for i in range(2)]
    queued = {"r0": 500_000}  # far more than the head, or the session's whole context, saves
    homed = first_turn("s", 100, matched_blocks={"r0": HEAD_BLOCKS + 100}, queued_prefill=queued)
    homed.home_rank = "r0"
    assert first("prefix_affinity", homed, fleet) == "r0"
    # a known session (its rank per the index, not admitted: admission off) stays while within the bound
    known = first_turn("s", 100, matched_blocks={"r0": HEAD_BLOCKS + 100}, queued_prefill=queued)
    known.session_rank = "r0"
    assert first("prefix_affinity", known, fleet) == "r0"


def test_the_ranks_measured_speeds_weigh_their_queues_alike_at_any_time_scale() -> None:
    fleet = two_ranks(1, 1)
    request = first_turn("s", 2000, matched_blocks={"r0": HEAD_BLOCKS}, queued_prefill={"r0": 10_000})
    assert first("prefix_affinity", request, fleet) == "r0"  # 10k queued < the 15k head saves
    # r0 computes a token in 3x the time r1 does: its 10k queued + 32k miss take longer than r1's 47k
    request.seconds_per_token = {"r0": 1.5e-4, "r1": 5e-5}
    assert first("prefix_affinity", request, fleet) == "r1"
    # the same ranks on a replay compressed 100x measure 100x less time per token: the same choice
    request.seconds_per_token = {"r0": 1.5e-6, "r1": 5e-7}
    assert first("prefix_affinity", request, fleet) == "r1"
    # equal speeds measured: tokens weigh alike, as with none measured
    request.seconds_per_token = {"r0": 7e-6, "r1": 7e-6}
    assert first("prefix_affinity", request, fleet) == "r0"


class Speeds:
    def __init__(self, measured: dict[str, float]) -> None:
        self._measured = measured

    def measured(self) -> dict[str, float]:
        return self._measured

    def cpu_load_costs(self) -> dict[str, float]:
        return {}


def head_blocks_ctx(session: str, rest_blocks: int) -> RequestContext:
    """A first turn as the blocks stage leaves it: its prompt's blocks, whose head is the agent's."""
    ctx = make_ctx(session, HEAD_CHAIN + chain(session, rest_blocks, HEAD_CHAIN[-1]))
    assert ctx.prompt_tokens is not None
    ctx.prompt_blocks = PromptBlocks(
        ctx.prompt_tokens, BLOCK, ctx.block_hashes, (), array("I"), shared_tokens=HEAD
    )
    return ctx


def route_wave(router: Router, sessions: list[str], rest_blocks: int) -> list[str]:
    """Route the first turns of ``sessions`` one after another, each held in flight."""
    chosen = []
    for session in sessions:
        ctx = head_blocks_ctx(session, rest_blocks)
        rank = pick(router, ctx)
        rank.in_flight += 1
        chosen.append(rank.name)
    return chosen


def test_a_wave_of_large_first_turns_spreads_and_small_ones_share_the_heads_rank() -> None:
    fleet = make_pool(2, block_size=BLOCK)
    # CHWBL's request bound out of the way (factor 10): what is left is the queued prefill
    router = Router(fleet, make_policy("prefix_affinity", balance_factor=10), block_size=BLOCK)
    router.index.record("r1", HEAD_CHAIN)  # another session of the agent left its head on r1
    # small first turns (300 tokens past the head each) share the head's rank: 20 queue 6k there
    small = route_wave(router, [f"small{i}" for i in range(20)], 19)
    assert small == ["r1"] * 20
    for rank in fleet:
        rank.in_flight = 0
    router.queued_prefill = {"r0": 0, "r1": 0}
    router.inflight_tokens = {"r0": 0, "r1": 0}
    # large ones (30k past the head): the second goes to the idle rank at the cost of its head, and
    # from then on both ranks hold the head (the index records what was routed) and share the wave
    large = route_wave(router, [f"large{i}" for i in range(8)], 1900)
    assert large[:2] == ["r1", "r0"]
    assert large.count("r0") == large.count("r1") == 4


def head_router(queued_on_head_rank: int, speeds: dict[str, float] | None = None) -> Router:
    """Two idle ranks, r0 holding the agent's head with ``queued_on_head_rank`` prefill queued."""
    router = Router(
        make_pool(2, block_size=BLOCK),
        make_policy("prefix_affinity", balance_factor=10),
        block_size=BLOCK,
        speeds=Speeds(speeds or {}),
    )
    router.index.record("r0", HEAD_CHAIN)
    router.queued_prefill["r0"] = queued_on_head_rank
    return router


def test_the_router_gives_the_policy_the_head_and_the_ranks_speeds() -> None:
    # more queued than the head saves: a new session goes to r1; less: it joins the head on r0
    assert route_wave(head_router(HEAD + 1024), ["a"], 100) == ["r1"]
    assert route_wave(head_router(HEAD - 1024), ["b"], 100) == ["r0"]
    # r0 measured 2x slower per token than r1: its 14k queued and 1.6k miss cost more than r1's 17k
    assert route_wave(head_router(HEAD - 1024, {"r0": 2e-6, "r1": 1e-6}), ["c"], 100) == ["r1"]
    # and admission's home still wins over all of it
    router = head_router(10 * HEAD)
    ctx = head_blocks_ctx("d", 100)
    ctx.admitted = Admitted(home="r0")
    assert pick(router, ctx).name == "r0"


@given(
    st.lists(st.floats(1e-9, 1.0), min_size=1, max_size=6),
    st.floats(1e-4, 1e4),
)
def test_token_weights_are_ratios_so_compressing_time_changes_nothing(
    speeds: list[float], scale: float
) -> None:
    fleet = [Rank(f"r{i}", "http://127.0.0.1:1") for i in range(len(speeds) + 1)]  # the last unmeasured
    measured = {f"r{i}": s for i, s in enumerate(speeds)}
    weights = token_weights(fleet, measured)
    scaled = token_weights(fleet, {k: v * scale for k, v in measured.items()})
    assert all(abs(weights[k] - scaled[k]) <= 1e-9 * weights[k] for k in weights)
    assert abs(sum(weights[f"r{i}"] for i in range(len(speeds))) / len(speeds) - 1.0) < 1e-9
    assert weights[f"r{len(speeds)}"] == 1.0  # a rank not measured weighs the mean
    assert token_weights(fleet, {}) == dict.fromkeys(weights, 1.0)


@given(
    head=st.integers(0, 50_000),
    own=st.integers(0, 100_000),
    rest=st.integers(1, 100_000),
    queued=st.integers(0, 500_000),
    more=st.integers(1, 100_000),
)
def test_placement_score_prefers_less_queue_and_counts_the_head_once_own_blocks_twice(
    head: int, own: int, rest: int, queued: int, more: int
) -> None:
    prompt = head + own + rest
    holder = placement_score(head + own, head, prompt, queued)
    # more queued there: worth less
    assert placement_score(head + own, head, prompt, queued + more) < holder
    # against an idle rank holding nothing: the holder wins exactly while its queue is below what it
    # saves, the head once and the session's own blocks twice
    idle = placement_score(0, head, prompt, 0)
    assert (holder > idle) == (queued < head + 2 * own)
    # against an idle rank holding the head too: only the session's own blocks and the queue count
    idle_with_head = placement_score(head, head, prompt, 0)
    assert (holder > idle_with_head) == (queued < 2 * own)
