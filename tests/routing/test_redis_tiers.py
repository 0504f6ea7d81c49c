"""The shared Redis index keeps each rank's blocks by tier: a replica that reads only Redis (started
after the rank, subscribed to nothing) sees, for every prompt, the same blocks held and the same
blocks in CPU memory only as the replica whose KV events wrote them, through demotions, reloads,
CPU evictions, a tier cleared and the writer's lease passing to another replica."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import pytest

from proxy.state.redis.index import RedisPrefixIndex
from routing.index import CPU, GPU, Lookup
from tests.routing.conftest import RedisServer, chain
from tests.routing.test_redis_event_writer import LEASE_S, replicas_on


@pytest.fixture
def stores(redis_server: RedisServer) -> Iterator[list[RedisPrefixIndex]]:
    """Two replicas subscribed to rank ``r``'s events, and a reader subscribed to nothing."""
    with replicas_on(redis_server.url) as made:
        yield made


def stored(replicas: Sequence[RedisPrefixIndex], blocks: list[bytes], medium: str = GPU) -> None:
    for replica in replicas:
        replica.record("r", blocks, counted=True, medium=medium)
        replica.flush()


def removed(replicas: Sequence[RedisPrefixIndex], blocks: list[bytes], medium: str = GPU) -> None:
    for replica in replicas:
        replica.remove("r", blocks, counted=True, medium=medium)
        replica.flush()


def by_tier(found: Lookup) -> tuple[dict[str, int], dict[str, int]]:
    return found.matches, found.offloaded


def assert_agree(exact: RedisPrefixIndex, reader: RedisPrefixIndex, prompts: list[list[bytes]]) -> None:
    for prompt in prompts:
        assert by_tier(reader.lookup(prompt, None)) == by_tier(exact.local.lookup(prompt, None))


def test_a_replica_reading_redis_agrees_with_the_event_fed_one_by_tier(
    stores: list[RedisPrefixIndex],
) -> None:
    first, second, reader = stores
    both = [first, second]
    a, b = chain("a", 12), chain("b", 8)
    prompts = [a, a[:5], a[:9], b, b[:3]]
    stored(both, a)
    stored(both, b)
    assert_agree(first, reader, prompts)
    assert reader.lookup(a, None).offloaded == {}

    # the GPU evicts a's tail, its offloading connector keeping a copy: demoted, still held
    stored(both, a[7:], CPU)
    removed(both, a[7:])
    found = reader.lookup(a, None)
    assert (found.matches, found.offloaded) == ({"r": 12}, {"r": 5})
    assert reader.lookup(a[:9], None).offloaded == {"r": 2}
    assert_agree(first, reader, prompts)

    # the CPU tier evicts a's last block (no GPU copy): removed; b's tail evicted without a copy
    removed(both, a[11:], CPU)
    removed(both, b[6:])
    assert by_tier(reader.lookup(a, None)) == ({"r": 11}, {"r": 4})
    assert_agree(first, reader, prompts)

    # a prompt reloads two of a's CPU blocks back to the GPU (they keep their CPU copy)
    stored(both, a[7:9])
    assert by_tier(reader.lookup(a, None)) == ({"r": 11}, {"r": 2})
    assert_agree(first, reader, prompts)

    # the CPU tier is cleared: the blocks it alone held go, the GPU's stay
    for replica in both:
        replica.clear("r", CPU)
        replica.flush()
    assert by_tier(reader.lookup(a, None)) == ({"r": 9}, {})
    assert_agree(first, reader, prompts)


def test_the_next_writer_pushes_the_tiers_it_kept_while_another_wrote(
    stores: list[RedisPrefixIndex],
) -> None:
    first, second, reader = stores
    a = chain("a", 10)
    stored([first, second], a)
    stored([first, second], a[6:], CPU)
    first.close()  # the writer is gone: its lease lapses
    removed([second], a[6:])  # demoted within the lease: nobody writes it to Redis yet
    assert reader.lookup(a, None).offloaded == {}
    time.sleep(LEASE_S * 1.5)
    c = chain("c", 3)
    stored([second], c)  # the next event: second takes the lease over and pushes its mirror
    assert second.stats()["redis_event_writer_of"] == ["r"]
    assert_agree(second, reader, [a, a[:8], c])
    assert reader.lookup(a, None).offloaded == {"r": 4}
