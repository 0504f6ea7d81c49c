"""The prefix index's semantics, identical for the memory store and the Redis store (real server)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from proxy.state.redis.index import RedisPrefixIndex
from routing.index import PrefixIndex
from routing.index.memory import MemoryPrefixIndex
from tests.routing.conftest import RedisServer, chain


class ReadYourWritesRedisIndex(RedisPrefixIndex):
    """Redis writes are asynchronous (a writer thread); these tests read Redis's settled state."""

    def lookup(self, block_hashes, session_key):  # type: ignore[no-untyped-def]
        self.flush()
        return super().lookup(block_hashes, session_key)


@pytest.fixture(params=["memory", "redis"])
def index(request: pytest.FixtureRequest) -> Iterator[PrefixIndex]:
    if request.param == "memory":
        yield MemoryPrefixIndex()
        return
    server: RedisServer = request.getfixturevalue("redis_server")
    store = ReadYourWritesRedisIndex(server.url, model="m", block_size=16)
    yield store
    assert store.up, "redis store fell back to its local mirror during the test"
    store.close()


def test_match_walks_from_block_zero_and_stops_at_first_miss(index: PrefixIndex) -> None:
    for name in ("a", "b", "c"):
        index.set_capacity(name, None)
    shared = chain("sys", 8)
    a_tail = chain("a", 4, shared[-1])
    index.record("a", shared + a_tail)
    index.record("b", shared[:5])
    index.record("c", a_tail)  # no block 0: never a hit
    assert index.match(shared + a_tail) == {"a": 12, "b": 5}
    assert index.match(shared + chain("other", 3, shared[-1])) == {"a": 8, "b": 5}
    assert index.match(chain("nothing", 3)) == {}
    assert index.match([]) == {}


def test_capacity_evicts_least_recent_chain_tail_first(index: PrefixIndex) -> None:
    index.set_capacity("a", 10)
    old = chain("old", 6)
    new = chain("new", 6)
    index.record("a", old)
    index.record("a", new)  # 12 blocks > 10: two blocks of the older chain go, its tail first
    assert index.match(new) == {"a": 6}
    assert index.match(old) == {"a": 4}


def test_remove_and_counted_copies(index: PrefixIndex) -> None:
    index.set_capacity("a", None)
    blocks = chain("x", 4)
    index.record("a", blocks, counted=True)
    index.record("a", blocks[:2], counted=True)  # a second physical copy of blocks 0-1
    index.remove("a", blocks[1:2], counted=True)
    assert index.match(blocks) == {"a": 4}, "one copy of block 1 is still held"
    index.remove("a", blocks[1:2], counted=True)
    assert index.match(blocks) == {"a": 1}
    index.remove("a", blocks[:1])  # uncounted: gone at once
    assert index.match(blocks) == {}


def test_clear_and_sessions(index: PrefixIndex) -> None:
    index.set_capacity("a", None)
    index.set_capacity("b", None)
    blocks = chain("y", 3)
    index.record("a", blocks)
    index.record("b", blocks)
    index.set_session_rank("s1", "b")
    found = index.lookup(blocks, "s1")
    assert found.matches == {"a": 3, "b": 3} and found.session_rank == "b"
    index.clear("a")
    assert index.match(blocks) == {"b": 3}
    assert index.lookup([], "unknown").session_rank is None


def test_redis_entries_expire(redis_server: RedisServer) -> None:
    store = RedisPrefixIndex(redis_server.url, model="m", block_size=16, ttl_s=0.3)
    store.set_capacity("a", None)
    blocks = chain("t", 5)
    store.record("a", blocks)
    store.flush()
    assert store.match(blocks) == {"a": 5}
    time.sleep(0.5)
    store.local.clear("a")  # look at Redis only: the local mirror does not expire
    assert store.match(blocks) == {}
    store.close()


def test_a_clear_lands_after_the_writes_queued_before_it(redis_server: RedisServer) -> None:
    """A rank's blocks cleared (its AllBlocksCleared event) stay cleared in Redis: a write of them
    still queued on the link's thread when the clear comes does not bring them back as it lands."""
    store = RedisPrefixIndex(redis_server.url, model="m", block_size=16)
    store.set_capacity("a", None)
    blocks = chain("q", 4)
    release = threading.Event()
    store.link.submit(lambda: release.wait(10))  # the link's thread is busy: what follows queues
    try:
        store.record("a", blocks)
        store.clear("a")
    finally:
        release.set()
    store.flush()
    assert store.match(blocks) == {}  # the mirror was cleared: this is what Redis holds
    store.record("a", blocks[:2])  # recorded after the clear: kept
    store.flush()
    assert store.match(blocks) == {"a": 2}
    store.local.clear("a")
    assert store.match(blocks) == {"a": 2}
    store.close()


def test_redis_namespaces_per_model_block_size_and_hash_algo(redis_server: RedisServer) -> None:
    one = RedisPrefixIndex(redis_server.url, model="m1", block_size=16)
    other_model = RedisPrefixIndex(redis_server.url, model="m2", block_size=16)
    other_size = RedisPrefixIndex(redis_server.url, model="m1", block_size=32)
    other_algo = RedisPrefixIndex(redis_server.url, model="m1", block_size=16, hash_algo="xxh3")
    same = RedisPrefixIndex(redis_server.url, model="m1", block_size=16)
    stores = (one, other_model, other_size, other_algo, same)
    for store in stores:
        store.set_capacity("a", None)
    blocks = chain("n", 4)
    one.record("a", blocks)
    one.flush()
    assert other_model.match(blocks) == {}
    assert other_size.match(blocks) == {}
    assert other_algo.match(blocks) == {}, "a replica hashing with another algorithm keeps its own keys"
    assert same.match(blocks) == {"a": 4}, "a second replica sees what the first recorded"
    for store in stores:
        store.close()


def test_redis_down_falls_back_then_resyncs(redis_server: RedisServer) -> None:
    states: list[bool] = []
    store = RedisPrefixIndex(
        redis_server.url, model="m", block_size=16, retry_interval=0.1, on_state=states.append
    )
    store.set_capacity("a", None)
    before = chain("before", 4)
    store.record("a", before)
    redis_server.stop()
    during = chain("during", 4)
    store.record("a", during)  # Redis is gone: applied locally, no exception
    assert store.match(before) == {"a": 4}
    assert store.match(during) == {"a": 4}
    assert store.up is False and states == [False]
    redis_server.start()  # same port, empty: the local mirror must be pushed back
    time.sleep(0.15)
    assert store.match(during) == {"a": 4}
    assert store.up is True and states == [False, True]
    peer = RedisPrefixIndex(redis_server.url, model="m", block_size=16)
    peer.set_capacity("a", None)
    assert peer.match(before) == {"a": 4} and peer.match(during) == {"a": 4}
    peer.close()
    store.close()


def test_resync_keeps_session_bindings_under_a_sub_second_ttl(redis_server: RedisServer) -> None:
    # A replay scales the TTL down: under 1 s, the resync's SET ... EX 0 was refused by Redis.
    store = RedisPrefixIndex(redis_server.url, model="m", block_size=16, ttl_s=0.5)
    store.set_capacity("a", None)
    store.set_session_rank("s1", "a")
    store.flush()
    store.resync()  # raises on a Redis error
    peer = RedisPrefixIndex(redis_server.url, model="m", block_size=16, ttl_s=0.5)
    peer.set_capacity("a", None)
    assert peer.lookup([], "s1").session_rank == "a"
    peer.close()
    store.close()


def test_tiers_keep_demoted_blocks_held(index: PrefixIndex) -> None:
    """Both stores: a GPU removal of a block with a CPU copy keeps it held (every tier counts); a
    CPU eviction or a clear of the CPU tier then drops it; a GPU clear keeps CPU copies."""
    index.set_capacity("a", None)
    blocks = chain("tier", 4)
    index.record("a", blocks, counted=True)
    index.record("a", blocks[2:], counted=True, medium="CPU")
    index.remove("a", blocks[1:], counted=True)
    assert index.match(blocks) == {"a": 1}, "block 1 had no CPU copy"
    index.record("a", blocks[1:2], counted=True)
    assert index.lookup(blocks, None).matches == {"a": 4}
    assert index.lookup(blocks, None).offloaded == {"a": 2}
    index.remove("a", blocks[3:], counted=True, medium="CPU")
    assert index.match(blocks) == {"a": 3}
    index.clear("a", "GPU")
    assert index.match(blocks) == {}, "block 0 was on the GPU only"
    assert index.match(blocks[2:]) == {"a": 1}, "block 2's CPU copy stays"
    index.clear("a", "CPU")
    assert index.match(blocks[2:]) == {}
