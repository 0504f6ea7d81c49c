"""The budget and room of a rank that offloads KV to CPU memory: its GPU pool plus its CPU tier once
the tier has shown its size, unbounded until then; a rank that does not offload keeps its pool."""

from __future__ import annotations

from proxy.admission.accounting import RankState, budget_tokens, count, held_tokens
from proxy.admission.config import AdmissionConfig
from proxy.admission.room import excess_tokens, find_room
from proxy.state.sessions import Session
from routing.ranks import Fleet, Rank

POOL = 1000
TIER = 4000
FRACTION = 0.8


def counted(rank: Rank, *contexts: int) -> RankState:
    """``rank``'s count with one active, answered session per context size."""
    sessions = []
    for n, tokens in enumerate(contexts):
        session = Session(f"s{n}", created=0.0, last_seen=99.0, rank=rank.name, context_tokens=tokens)
        session.answered_at = 99.0
        sessions.append(session)
    states = count(
        Fleet([rank]),
        sessions,
        [],
        AdmissionConfig(target_fraction=FRACTION),
        now=100.0,
        expected_peak=lambda tokens: tokens,
        release_after=lambda session: 3600.0,
        idle_ttl=3600.0,
    )
    return states[rank.name]


def allowed(rank: Rank, state: RankState, need: int) -> bool:
    return rank.name in find_room([rank], {rank.name: state}, need, None, 0, None).allowed


def test_a_learned_cpu_tier_grows_the_budget_by_the_tier() -> None:
    rank = Rank("r0", "http://r0", pool_tokens=POOL, offloads_kv=True, cpu_tier_tokens=TIER)
    assert held_tokens(rank) == POOL + TIER
    assert budget_tokens(rank, FRACTION) == int(FRACTION * (POOL + TIER))
    state = counted(rank, 1500, 1500)  # three times a GPU-only budget (800), within the tiers
    assert state.budget_tokens == 4000 and state.holds_tokens == 5000 and state.pool_tokens == POOL
    assert not state.over_pool and excess_tokens(state) <= 0
    assert allowed(rank, state, 1000)  # 4,000 of 4,000
    assert not allowed(rank, state, 1001)  # the tier's budget binds past that


def test_an_offloading_rank_whose_tier_has_not_shown_its_size_is_not_bound() -> None:
    rank = Rank("r0", "http://r0", pool_tokens=POOL, offloads_kv=True)
    assert held_tokens(rank) is None and budget_tokens(rank, FRACTION) is None
    state = counted(rank, 3000, 3000)  # past the pool: no move, no refusal
    assert state.budget_tokens is None and state.holds_tokens is None
    assert not state.over_pool and excess_tokens(state) == 0
    assert allowed(rank, state, 10_000)


def test_a_rank_that_does_not_offload_keeps_its_pool_budget() -> None:
    # a tier size from an earlier life of the rank is not counted while it does not offload
    for tier in (None, TIER):
        rank = Rank("r0", "http://r0", pool_tokens=POOL, cpu_tier_tokens=tier)
        assert held_tokens(rank) == POOL and budget_tokens(rank, FRACTION) == 800
        state = counted(rank, 500)
        assert state.budget_tokens == 800 and state.holds_tokens == POOL
        assert allowed(rank, state, 300) and not allowed(rank, state, 301)
        assert counted(rank, 600, 500).over_pool
    assert budget_tokens(Rank("r0", "http://r0"), FRACTION) is None  # pool unknown: as before


def test_the_tier_learned_keeps_the_largest_size_seen() -> None:
    rank = Rank("r0", "http://r0", pool_tokens=POOL, offloads_kv=True)
    rank.learned_cpu_tier(2000)
    rank.learned_cpu_tier(1500)  # it evicted holding less (blocks it never announced): no shrink
    assert rank.cpu_tier_tokens == 2000
    rank.learned_cpu_tier(2016)
    assert rank.cpu_tier_tokens == 2016 and budget_tokens(rank, FRACTION) == int(FRACTION * 3016)
