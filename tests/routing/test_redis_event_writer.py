"""Replicas that all subscribe to a rank's KV events write its mirror to the shared Redis index once:
the holder of the rank's lease writes, the others keep their own mirrors only; when the writer
stops, another takes the lapsed lease over and pushes its mirror, so nothing it skipped is lost.

A reader (a replica subscribed to nothing, its local mirror empty) shows what Redis holds."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import pytest

from proxy.state.redis.index import RedisPrefixIndex
from tests.routing.conftest import RedisServer, chain

LEASE_S = 0.3


@contextlib.contextmanager
def replicas_on(url: str) -> Iterator[list[RedisPrefixIndex]]:
    """Two subscribing replicas' indexes and a reader's, on the Redis at ``url``."""
    made = [RedisPrefixIndex(url, model="m", events_lease_s=LEASE_S) for _ in range(3)]
    for store in made:
        store.set_capacity("r", None)
    try:
        yield made
    finally:
        for store in made:
            store.close()


@pytest.fixture
def stores(redis_server: RedisServer) -> Iterator[list[RedisPrefixIndex]]:
    with replicas_on(redis_server.url) as made:
        yield made


def apply_event(replicas: list[RedisPrefixIndex], blocks: list[bytes], stored: bool = True) -> None:
    """Every replica applies the same KV event (each has its own subscription), in turn."""
    for replica in replicas:
        if stored:
            replica.record("r", blocks, counted=True)
        else:
            replica.remove("r", blocks, counted=True)
        replica.flush()


def test_an_event_is_written_to_redis_by_one_replica(stores: list[RedisPrefixIndex]) -> None:
    an_event_is_written_to_redis_by_one_replica(stores)


def an_event_is_written_to_redis_by_one_replica(stores: list[RedisPrefixIndex]) -> None:
    first, second, reader = stores
    blocks = chain("sys", 6)
    apply_event([first, second], blocks)
    apply_event([first, second], blocks[4:], stored=False)  # the rank evicted the chain's tail
    assert reader.match(blocks) == {"r": 4}
    assert first.full_writes == 1 and second.full_writes == 0
    assert first.event_writes == 2 and second.event_writes == 0
    assert first.stats()["redis_event_writer_of"] == ["r"] and second.stats()["redis_event_writer_of"] == []
    for replica in (first, second):  # each keeps the exact mirror of its own
        assert replica.local.match(blocks) == {"r": 4}


def test_when_the_writer_stops_another_takes_over_and_pushes_what_it_skipped(
    stores: list[RedisPrefixIndex],
) -> None:
    first, second, reader = stores
    old = chain("old", 3)
    apply_event([first, second], old)
    first.close()  # the writer is gone: its lease lapses
    skipped = chain("skipped", 3)
    apply_event([second], skipped)  # within the lease: nobody writes it to Redis
    assert reader.match(skipped) == {}
    time.sleep(LEASE_S * 1.5)
    fresh = chain("fresh", 3)
    apply_event([second], fresh)
    assert second.stats()["redis_event_writer_of"] == ["r"]
    for blocks in (old, skipped, fresh):
        assert reader.match(blocks) == {"r": 3}


def test_a_writer_quiet_past_its_lease_keeps_writing_without_a_push(stores: list[RedisPrefixIndex]) -> None:
    first, second, _ = stores
    apply_event([first, second], chain("a", 4))
    time.sleep(LEASE_S * 1.5)  # no events: the lease lapsed, nobody else took it
    apply_event([first, second], chain("b", 4))
    assert first.full_writes == 2, "one write per event: no push of the whole mirror"
    assert second.full_writes == 0


def test_the_writer_keeps_blocks_the_rank_still_holds_from_expiring(redis_server: RedisServer) -> None:
    """A block the rank keeps (its hits write no event) is pushed again before the index TTL ends."""
    ttl = 1.0
    writer, reader = (
        RedisPrefixIndex(redis_server.url, model="m", ttl_s=ttl, events_lease_s=0.3) for _ in "ab"
    )
    reader.set_capacity("r", None)
    try:
        held = chain("system", 4)
        apply_event([writer], held)
        for n in range(6):  # 1.8 s of events on other blocks: past the TTL of the first write
            time.sleep(ttl * 0.3)
            apply_event([writer], chain(f"turn{n}", 1))
        assert reader.match(held) == {"r": 4}
    finally:
        writer.close()
        reader.close()
