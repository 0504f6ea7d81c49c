"""Blocks routed to an event-fed rank count as held there until its events come or their time is up."""

from __future__ import annotations

from proxy.stages.route import Router
from routing.index.inflight import (
    DEFAULT_ALLOWANCE_S,
    LAG_WINDOW,
    MIN_ALLOWANCE_S,
    MIN_SAMPLES,
    InFlightBlocks,
)
from routing.index.memory import MemoryPrefixIndex
from routing.policies import make_policy
from routing.ranks import Fleet, Rank
from tests.routing.conftest import make_ctx, observe, pick

H = [bytes([k]) * 8 for k in range(8)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_blocks_count_after_the_held_prefix_until_confirmed() -> None:
    inflight = InFlightBlocks(Clock())
    inflight.add("r0", H[2:6])
    matches = {"r0": 2, "r1": 3}
    inflight.extend(H, matches)
    assert matches == {"r0": 6, "r1": 3}  # r1 has nothing in flight
    fresh: dict[str, int] = {}
    inflight.extend(H, fresh)
    assert fresh == {}  # blocks in flight past a block nobody holds do not count
    inflight.confirm("r0", H[2:4])  # the mirror holds these now
    matches = {"r0": 4}
    inflight.extend(H, matches)
    assert matches == {"r0": 6}
    assert inflight.size() == 2 and inflight.confirmed == 2


def test_unconfirmed_blocks_expire_an_allowance_after_their_last_request_was_prefilled() -> None:
    clock = Clock()
    inflight = InFlightBlocks(clock)
    first = inflight.add("r0", H[:4])
    second = inflight.add("r0", H[:2])  # a sibling routed on the same head
    inflight.prefilled("r0", first)
    clock.now += 10 * DEFAULT_ALLOWANCE_S  # the sibling is still prefilling: its blocks stay
    matches: dict[str, int] = {}
    inflight.extend(H, matches)
    assert matches == {"r0": 2}
    inflight.prefilled("r0", second)
    clock.now += DEFAULT_ALLOWANCE_S / 2
    matches = {}
    inflight.extend(H, matches)
    assert matches == {"r0": 2}
    clock.now += DEFAULT_ALLOWANCE_S
    matches = {}
    inflight.extend(H, matches)
    assert matches == {}
    inflight.add("r1", H[6:7])  # any write sweeps what expired
    assert inflight.size() == 1 and inflight.expired == 4


def test_the_allowance_is_learned_from_how_late_events_come() -> None:
    clock = Clock()
    inflight = InFlightBlocks(clock)
    assert inflight.allowance() == DEFAULT_ALLOWANCE_S
    for k in range(MIN_SAMPLES):
        block = [bytes([k]) * 4]
        inflight.prefilled("r0", inflight.add("r0", block))
        clock.now += 0.4  # every event comes 400 ms after its request's first token
        inflight.confirm("r0", block)
    assert abs(inflight.allowance() - 0.8) < 1e-9  # twice the lag seen
    for k in range(LAG_WINDOW):  # then, as many events come before their first token: lag 0
        block = [k.to_bytes(4, "big")]
        inflight.add("r0", block)
        inflight.confirm("r0", block)
    assert inflight.allowance() == MIN_ALLOWANCE_S  # the floor: a straggler still counts a while


def test_a_sibling_routed_before_the_first_ones_events_follows_it_and_is_estimated_right() -> None:
    ranks = [Rank("r0", "http://127.0.0.1:1", block_size=16), Rank("r1", "http://127.0.0.1:2", block_size=16)]
    router = Router(Fleet(ranks), make_policy("prefix_affinity"), MemoryPrefixIndex(), exact=["r0", "r1"])
    head = H[:3]
    first = make_ctx("a", [*head, H[3], H[4]], 16 * 5 + 5)
    home = pick(router, first)
    # The first one's answer came, its events not yet; the sibling shares its head.
    observe(router, first, home, 0)
    second = make_ctx("b", [*head, H[5]], 16 * 4 + 5)
    assert pick(router, second) is home
    assert second.estimated_cached_tokens == 3 * 16
    assert router.holds(second.block_hashes) == {home.name: 4}  # its own new block is on its way too
    # Its events came: the mirror holds the blocks, nothing of them is in flight any more.
    router.inflight_blocks.confirm(home.name, first.block_hashes)
    router.index.record(home.name, first.block_hashes, counted=True)
    assert router.holds(first.block_hashes) == {home.name: 5}
    assert router.inflight_blocks.size() == 1  # the sibling's own new block, still prefilling
