"""The ``cost`` policy (the default), on a fake clock: a new session finding no room goes past the
budget when evicting costs less than waiting (fast ranks), waits for room when the ranks are
compute-bound (the budget holds), is never refused for lack of room, and a returning session goes
back to the rank that still holds its blocks."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from proxy.admission import Admission, AdmissionConfig
from proxy.context import Outcome
from proxy.errors import ProxyError
from proxy.stages.usage import Usage
from proxy.state.memory import MemorySessionStore
from proxy.state.sessions import SessionTable
from routing.rank_metrics import Histogram, RankSample
from routing.ranks import Fleet, Rank
from tests.admission.test_release import BLOCK, POOL, Clock, ctx_for

TTL = 20.0


class FakePlacement:
    """What the router tells admission: the blocks each rank holds, the prefill queued on each."""

    def __init__(self) -> None:
        self.held: dict[str, dict[str, int]] = {}  # session -> rank -> blocks
        self.prefill: dict[str, int] = {}

    def holds(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        key = block_hashes[-1].decode().rstrip("0123456789") if block_hashes else ""
        return self.held.get(key, {})

    def queued(self, rank: str) -> int:
        return self.prefill.get(rank, 0)


def make(ranks: int = 1, **config: object) -> tuple[Admission, Clock, FakePlacement]:
    clock = Clock()
    table = SessionTable(MemorySessionStore(), TTL, clock)
    fleet = Fleet(Rank(f"r{i}", f"http://r{i}", pool_tokens=POOL) for i in range(ranks))
    options: dict[str, object] = {"idle_ttl": TTL, "wait": 30.0, "block_size": BLOCK, **config}
    placement = FakePlacement()
    adm = Admission(table, fleet, AdmissionConfig(**options), None, placement)  # type: ignore[arg-type]
    return adm, clock, placement


def teach_speed(adm: Admission, rank: str, tokens_per_s: float) -> None:
    """Two scrapes of ``rank``'s metrics: 100k prompt tokens computed in prefill between them."""
    computed = 100_000
    first = RankSample(0.0, {"prompt_tokens": 0.0, "cached_tokens": 0.0}, {"prefill": Histogram(0.0, 0.0)})
    second = RankSample(
        2.0,
        {"prompt_tokens": float(computed), "cached_tokens": 0.0, "waiting": 0.0},
        {"prefill": Histogram(computed / tokens_per_s, 10.0)},
    )
    adm.observe_rank(rank, first)
    adm.observe_rank(rank, second)


HEAD = {"head": b"shared-head", "head_tokens": 32}


async def turn(adm: Admission, key: str, tokens: int, rank: str | None = None) -> None:
    ctx = ctx_for(key, tokens, **HEAD)  # type: ignore[arg-type]
    ctx.admitted = await adm.admit(ctx)
    session = ctx.admitted.session
    assert session is not None
    name = rank or ctx.admitted.home or session.rank or sorted(ctx.admitted.allowed or {"r0"})[0]
    placed = adm.fleet.get(name)
    assert placed is not None
    adm.placed(ctx, placed)
    adm.finished(Outcome(ctx, name, 200, Usage(tokens, 16, 0)))


def teach_endings(adm: Admission) -> None:
    """Earlier traffic: think gaps of 1 s, and as many sessions ending as coming back (so a session
    just answered comes back half the time, and one quiet for over 1 s has ended)."""
    for _ in range(20):
        adm.time.note_gap(1.0)
        adm.time.note_returns(1)
        adm.time.note_end(turns=4)


async def two_thinkers(adm: Admission, clock: Clock) -> None:
    """Sessions a and b on r0 (784 tokens each: 1,568 of its 1,600 budget), each with three 1 s
    think gaps, both just answered: judged ended 1 s from now, if they do not come back."""
    teach_endings(adm)
    for key in ("a", "b"):
        await turn(adm, key, 600)
    for _ in range(3):
        clock.now += 1
        for key in ("a", "b"):
            await turn(adm, key, 768)


async def test_fast_ranks_take_a_new_session_past_the_budget_at_once() -> None:
    adm, clock, _ = make()
    teach_speed(adm, "r0", 1_000_000)  # recomputing what c evicts takes about a millisecond
    await two_thinkers(adm, clock)
    new = ctx_for("c", 700)
    new.admitted = await adm.admit(new)  # no room, but evicting is cheaper than 2 s of waiting
    assert new.admitted.waited_s == 0 and new.admitted.allowed == {"r0"}
    record = new.admitted.session.admission  # type: ignore[union-attr]
    assert record["decision"] == "over_budget" and "costs less" in record["reason"]
    (option,) = record["options"]
    assert option["rank"] == "r0" and option["evicted_tokens"] > 0
    assert option["room_in_s"] == pytest.approx(1.0)
    assert option["prefill_tokens_per_s"] == 1_000_000


async def test_compute_bound_ranks_hold_the_budget_until_room_comes() -> None:
    adm, clock, _ = make()
    teach_speed(adm, "r0", 100)  # evicting costs seconds of prefill: waiting 2 s is cheaper
    await two_thinkers(adm, clock)
    new = ctx_for("c", 700)
    waiting = asyncio.ensure_future(adm.admit(new))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiting.done() and len(adm.queue) == 1
    clock.now += 1.5  # a and b are judged ended: room
    adm.queue.notify()
    new.admitted = await asyncio.wait_for(waiting, 10)
    assert new.admitted.allowed == {"r0"} and new.admitted.waited_s > 0
    assert new.admitted.session.admission["decision"] == "room"  # type: ignore[union-attr]


async def test_no_session_is_refused_for_lack_of_room() -> None:
    adm, clock, _ = make(wait=0.0)  # no time to wait: at the bound at once
    teach_speed(adm, "r0", 100)
    await two_thinkers(adm, clock)
    big = ctx_for("big", 1900)  # larger than the rank's free room, smaller than its pool
    big.admitted = await adm.admit(big)
    assert big.admitted.allowed == {"r0"}
    record = big.admitted.session.admission  # type: ignore[union-attr]
    assert record["decision"] == "over_budget" and "no room is coming" in record["reason"]


async def test_without_measured_speeds_the_budget_holds_up_to_the_bound() -> None:
    adm, clock, _ = make(wait=0.05)
    await two_thinkers(adm, clock)
    new = ctx_for("c", 700)
    new.admitted = await adm.admit(new)  # waits the bound (nothing says evicting is cheap), then in
    assert new.admitted.waited_s > 0 and new.admitted.allowed == {"r0"}
    assert new.admitted.session.admission["decision"] == "after_wait"  # type: ignore[union-attr]


async def test_an_answer_while_a_session_waits_unmeasured_asks_for_a_scrape_now() -> None:
    adm, clock, _ = make()
    await two_thinkers(adm, clock)
    assert not adm.speeds.sooner.is_set()  # nobody waits: the regular polls are enough
    new = ctx_for("c", 700)
    waiting = asyncio.ensure_future(adm.admit(new))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiting.done() and len(adm.queue) == 1
    await turn(adm, "a", 784)  # an answer: the ranks have something to report
    assert adm.speeds.sooner.is_set()
    adm.speeds.sooner.clear()
    teach_speed(adm, "r0", 1_000_000)  # the scrape: evicting costs less than waiting
    new.admitted = await asyncio.wait_for(waiting, 10)
    assert new.admitted.session.admission["decision"] == "over_budget"  # type: ignore[union-attr]
    await turn(adm, "a", 800)
    assert not adm.speeds.sooner.is_set()  # measured: nothing more is asked


async def test_a_returning_session_goes_home_to_the_rank_holding_its_blocks() -> None:
    adm, clock, placement = make(ranks=2)
    await turn(adm, "a", 1200, rank="r1")
    clock.now += TTL + 1  # a idles out: it no longer counts
    assert adm.refresh()["r1"].sessions == 0
    await turn(adm, "x", 1500, rank="r1")  # r1 is now over budget with a back
    placement.held["a"] = {"r1": 1200 // BLOCK}  # the index: r1 still holds a's blocks
    back = ctx_for("a", 1300, **HEAD)  # type: ignore[arg-type]
    back.admitted = await adm.admit(back)
    assert back.admitted.home == "r1" and back.admitted.allowed is None
    assert back.admitted.session.admission["decision"] == "home"  # type: ignore[union-attr]


async def test_a_returning_session_whose_blocks_are_gone_is_placed_like_a_new_one() -> None:
    adm, clock, _ = make(ranks=2)
    await turn(adm, "a", 1200, rank="r1")
    clock.now += TTL + 1
    back = ctx_for("a", 1300, **HEAD)  # type: ignore[arg-type]  # the index: nothing holds it any more
    back.admitted = await adm.admit(back)
    assert back.admitted.home is None and back.admitted.allowed == {"r0", "r1"}


async def test_every_rank_saturated_is_overload_a_429_with_retry_after() -> None:
    adm, clock, placement = make(wait=1.0)
    teach_speed(adm, "r0", 1000)
    adm.speeds.observe("r0", RankSample(4.0, {"waiting": 12.0, "prompt_tokens": 100_000.0}, {}))
    await two_thinkers(adm, clock)
    placement.prefill["r0"] = 20_000  # 20 s of queued prefill: 8 wait bounds are 8 s
    with pytest.raises(ProxyError) as refused:
        await adm.admit(ctx_for("c", 700))
    assert refused.value.status == 429 and refused.value.code == "admission_overload"
    assert int(refused.value.headers["retry-after"]) >= 20


async def test_the_budget_policy_still_refuses_after_the_wait() -> None:
    adm, clock, _ = make(wait=0.0, policy="budget")
    teach_speed(adm, "r0", 1_000_000)
    await two_thinkers(adm, clock)
    with pytest.raises(ProxyError) as refused:
        await adm.admit(ctx_for("c", 700))
    assert refused.value.status == 429 and refused.value.code == "admission_pool_full"


async def test_a_session_whose_rank_lost_its_blocks_is_not_held_there() -> None:
    adm, _, _ = make(ranks=2)
    await turn(adm, "a", 600, rank="r1")
    kept = ctx_for("a", 800, **HEAD)  # type: ignore[arg-type]
    kept.admitted = await adm.admit(kept)
    assert kept.admitted.home == "r1"
    adm.placed(kept, adm.fleet.get("r1"))  # type: ignore[arg-type]
    adm.finished(Outcome(kept, "r1", 200, Usage(800, 16, 32)))  # r1 had evicted all but the head
    lost = ctx_for("a", 900, **HEAD)  # type: ignore[arg-type]
    lost.admitted = await adm.admit(lost)
    assert lost.admitted.home is None and lost.admitted.allowed is None  # the router's load bound decides
    assert adm.table.get("a").kept_share < 0.1  # type: ignore[union-attr]


async def test_a_session_on_a_rank_whose_prefill_queue_is_saturated_is_not_held_there() -> None:
    """A rank's requests in flight filling its pool never un-home a session (the router keeps it);
    a saturated prefill queue does: 8 wait bounds of queued prefill and requests waiting there."""
    adm, _, placement = make(ranks=2, wait=1.0)
    teach_speed(adm, "r1", 1000)
    await turn(adm, "a", 600, rank="r1")
    homed = ctx_for("a", 800, **HEAD)  # type: ignore[arg-type]
    placement.prefill["r1"] = 20_000  # 20 s of prefill queued, but the rank reports none waiting
    homed.admitted = await adm.admit(homed)
    assert homed.admitted.home == "r1"
    adm.speeds.observe("r1", RankSample(4.0, {"waiting": 12.0, "prompt_tokens": 100_000.0}, {}))
    saturated = ctx_for("a", 900, **HEAD)  # type: ignore[arg-type]
    saturated.admitted = await adm.admit(saturated)
    assert saturated.admitted.home is None and saturated.admitted.allowed is None  # the router decides
    placement.prefill["r1"] = 7_000  # 7 s: under 8 wait bounds
    drained = ctx_for("a", 1000, **HEAD)  # type: ignore[arg-type]
    drained.admitted = await adm.admit(drained)
    assert drained.admitted.home == "r1"
