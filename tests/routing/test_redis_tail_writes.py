"""The Redis index writes a returning chain's new tail only, and the whole chain when it must.

Every test reads Redis through a second store (another replica) whose local mirror is empty, so
what it matches is what Redis holds.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from proxy.state.redis.index import RedisPrefixIndex
from tests.routing.conftest import RedisServer, chain


@pytest.fixture
def pair(redis_server: RedisServer) -> Iterator[tuple[RedisPrefixIndex, RedisPrefixIndex]]:
    writer = RedisPrefixIndex(redis_server.url, model="m", block_size=16)
    reader = RedisPrefixIndex(redis_server.url, model="m", block_size=16)
    yield writer, reader
    writer.close()
    reader.close()


def _turns(writer: RedisPrefixIndex, rank: str, *lengths: int) -> list[bytes]:
    """Record a growing conversation (each turn extends the previous chain) and return the last."""
    blocks: list[bytes] = []
    for n in lengths:
        blocks = blocks + chain(f"turn{n}", n - len(blocks), blocks[-1] if blocks else b"")
        writer.record(rank, blocks)
        writer.flush()
    return blocks


def test_a_growing_conversation_writes_only_its_new_blocks(
    pair: tuple[RedisPrefixIndex, RedisPrefixIndex],
) -> None:
    writer, reader = pair
    writer.set_capacity("a", None)
    reader.set_capacity("a", None)
    blocks = _turns(writer, "a", 40, 44, 50, 51)
    assert (writer.full_writes, writer.tail_writes) == (1, 3), "turns after the first write their tail"
    assert reader.match(blocks) == {"a": 51}, "the other replica sees the whole conversation"


def test_a_tail_keeps_its_chain_in_lru_order(pair: tuple[RedisPrefixIndex, RedisPrefixIndex]) -> None:
    writer, reader = pair
    writer.set_capacity("a", 20)
    reader.set_capacity("a", 20)
    mine = _turns(writer, "a", 6, 10)  # 6 blocks whole, then a 4-block tail under them
    other = chain("other", 8)
    writer.record("a", other)
    writer.flush()
    assert writer.tail_writes == 1
    writer.record("a", chain("third", 6))  # 24 blocks > 20: the least recent chain's tail goes first
    writer.flush()
    assert reader.match(mine) == {"a": 6}, "the tail went before the head it hangs under"
    assert reader.match(other) == {"a": 8}


def test_the_whole_chain_is_written_again_when_redis_lost_its_head(
    pair: tuple[RedisPrefixIndex, RedisPrefixIndex], redis_server: RedisServer
) -> None:
    writer, reader = pair
    writer.set_capacity("a", None)
    reader.set_capacity("a", None)
    blocks = _turns(writer, "a", 10)
    redis.Redis.from_url(redis_server.url).delete(writer._lru_key("a"))  # e.g. evicted by another replica
    longer = blocks + chain("more", 3, blocks[-1])
    writer.record("a", longer)
    writer.flush()
    assert (writer.full_writes, writer.tail_writes) == (2, 0)
    assert reader.match(longer) == {"a": 13}


def test_a_chain_sunk_past_a_quarter_of_the_pool_is_written_whole(
    pair: tuple[RedisPrefixIndex, RedisPrefixIndex],
) -> None:
    writer, reader = pair
    writer.set_capacity("a", 40)
    reader.set_capacity("a", 40)
    blocks = _turns(writer, "a", 8)
    writer.record("a", chain("others", 12))  # 12 newer blocks: more than 40 / 4 above the chain
    writer.flush()
    longer = blocks + chain("more", 2, blocks[-1])
    writer.record("a", longer)
    writer.flush()
    assert (writer.full_writes, writer.tail_writes) == (3, 0), "rewritten whole to regain its place"
    writer.record("a", chain("newest", 12))
    writer.record("a", chain("newer", 12))  # 10 + 12 + 24 = 46 > 40: the 'others' chain goes
    writer.flush()
    assert reader.match(longer) == {"a": 10}
