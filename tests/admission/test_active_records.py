"""Admission's poll of the active sessions in Redis reads only the records written since the last
poll (``proxy/state/redis/changes.py``), and always returns what a whole read would."""

from __future__ import annotations

import random
from typing import Any

from proxy.state.redis.changes import ActiveRecords, mark
from proxy.state.redis.sessions import RedisSessionStore
from proxy.state.sessions import Session
from tests.admission.conftest import replica
from tests.helpers.redis_server import RedisServer


def whole(store: RedisSessionStore, since: float) -> dict[str, tuple[int, float, str | None]]:
    """What reading every active record afresh gives (a new reader, no history)."""
    fresh = ActiveRecords(store.redis, store._key, store._seen, store._counters, store._changes)
    return {s.key: (s.turns, s.last_seen, s.rank) for s in fresh.read(since, 0)}


def counting_mget(store: RedisSessionStore) -> list[int]:
    """Record how many records each of the store's ``MGET`` asks for."""
    asked: list[int] = []
    original = store.redis.mget

    def mget(keys: Any, *args: Any) -> Any:
        asked.append(len(keys))
        return original(keys, *args)

    store.redis.mget = mget  # type: ignore[method-assign]
    return asked


def test_a_poll_reads_only_the_records_written_since_the_last(redis_server: RedisServer) -> None:
    reader, writer = replica(redis_server), replica(redis_server)
    for n in range(50):
        writer.save(Session(f"k{n}", created=1.0, last_seen=10.0 + n))
    writer.link.flush()
    asked = counting_mget(reader)
    assert len(reader.seen_since(0.0)) == 50
    assert asked == [50]  # the first poll reads them all

    record = writer.get("k7")
    assert record is not None
    record.turns, record.rank = 4, "r2"  # another replica's turn, and a move that keeps last_seen
    writer.save(record)
    writer.delete("k9")
    writer.link.flush()
    found = {s.key: s for s in reader.seen_since(0.0)}
    assert asked == [50, 2]  # then only what was written: k7 and k9
    assert "k9" not in found and (found["k7"].turns, found["k7"].rank) == (4, "r2")
    assert len(found) == 49

    assert [s.key for s in reader.seen_since(55.0)] == ["k45", "k46", "k47", "k48", "k49"]
    assert asked == [50, 2]  # nothing written since: no record read
    assert len(reader.seen_since(0.0)) == 49  # further back than the last poll: read whole again
    assert reader.active.whole_reads == 2


def test_polls_agree_with_a_whole_read_whatever_the_writes(redis_server: RedisServer) -> None:
    """Saves, turns, moves and ends from two replicas in a random order: each poll of a third
    returns what a whole read returns."""
    reader, writers = replica(redis_server), [replica(redis_server), replica(redis_server)]
    rng = random.Random(7)
    clock = 100.0
    for step in range(300):
        writer = rng.choice(writers)
        key = f"k{rng.randrange(30)}"
        action = rng.random()
        clock += rng.random()
        if action < 0.15:
            writer.delete(key)
        else:
            record = writer.get(key) or Session(key, created=clock, last_seen=clock)
            record.turns += 1
            if action < 0.5:
                record.last_seen = clock
            record.rank = f"r{rng.randrange(3)}"
            writer.save(record)
        if step % 7 == 0:
            for w in writers:
                w.link.flush()
            since = clock - rng.uniform(0, 20) if rng.random() < 0.8 else 0.0
            polled = {s.key: (s.turns, s.last_seen, s.rank) for s in reader.seen_since(since)}
            assert polled == whole(reader, since)
    assert reader.active.whole_reads < 43 // 2  # most polls read only what changed


def test_a_trimmed_log_a_restart_or_a_resync_read_everything_again(redis_server: RedisServer) -> None:
    reader, writer = replica(redis_server), replica(redis_server)
    writer.save(Session("a", created=1.0, last_seen=5.0))
    writer.link.flush()
    assert [s.key for s in reader.seen_since(0.0)] == ["a"]
    reads = reader.active.whole_reads

    writer.redis.hset(writer._counters, "trimmed", reader.active.cursor + 1)  # the log lost an entry
    assert [s.key for s in reader.seen_since(0.0)] == ["a"]
    assert reader.active.whole_reads == reads + 1

    writer.redis.flushall()  # Redis restarted empty: the counter is behind the cursor
    writer.save(Session("b", created=1.0, last_seen=6.0))
    writer.link.flush()
    assert [s.key for s in reader.seen_since(0.0)] == ["b"]
    assert reader.active.whole_reads == reads + 2

    reader.link.resyncs += 1  # the link pushed the mirrors back: read whole
    assert [s.key for s in reader.seen_since(0.0)] == ["b"]
    assert reader.active.whole_reads == reads + 3


def test_the_change_log_keeps_its_newest_entries_and_says_how_far_it_was_trimmed(
    redis_server: RedisServer,
) -> None:
    client = replica(redis_server).redis
    log_write = client.register_script(mark(1, 2, "ARGV[1]", kept=3, slack=2))
    for n in range(6):  # 6 keys: past kept + slack = 5, the oldest 3 go
        log_write(keys=["counters", "changes"], args=[f"k{n}"])
    assert client.zrange("changes", 0, -1) == [b"k3", b"k4", b"k5"]
    assert client.hget("counters", "trimmed") == b"3"  # k0-k2 held scores 1-3
    log_write(keys=["counters", "changes"], args=["k3"])  # a key written again: one entry, new score
    assert client.zrange("changes", 0, -1, withscores=True) == [(b"k4", 5.0), (b"k5", 6.0), (b"k3", 7.0)]


def test_a_replica_that_only_polled_a_session_keeps_its_rank_when_redis_and_its_writer_are_gone(
    redis_server: RedisServer,
) -> None:
    """Another replica's records, as a poll read them, stay in this replica's mirror: a Redis that
    restarted empty after the replica that served a session died gets it back from the survivors,
    and the session keeps its rank; a record ended since leaves the mirror."""
    writer, survivor = replica(redis_server), replica(redis_server)
    writer.save(Session("a", created=1.0, last_seen=5.0, rank="r1"))
    writer.save(Session("b", created=1.0, last_seen=5.0, rank="r2"))
    writer.link.flush()
    assert {s.key for s in survivor.seen_since(0.0)} == {"a", "b"}
    writer.delete("b")
    writer.link.flush()
    assert {s.key for s in survivor.seen_since(0.0)} == {"a"}
    assert survivor.local.get("b") is None  # ended: not pushed back to life

    writer.close()  # the replica that served them dies
    survivor.redis.flushall()  # and Redis restarts empty
    found = survivor.get("a")
    assert found is not None and found.rank == "r1"  # lost by Redis, not ended: the mirror's copy
    survivor.resync()
    restored = replica(redis_server).get("a")
    assert restored is not None and (restored.rank, restored.last_seen) == ("r1", 5.0)
    assert replica(redis_server).get("b") is None


def test_a_poll_never_replaces_a_newer_copy_in_the_mirror(redis_server: RedisServer) -> None:
    """The mirror keeps the later version of its own copy and what a poll read."""
    mine, other = replica(redis_server), replica(redis_server)
    other.save(Session("a", created=1.0, last_seen=5.0, rank="r1"))
    other.link.flush()
    record = mine.get("a")
    assert record is not None
    record.turns, record.rank = 2, "r3"
    mine.save(record)  # version 2, here
    mine.link.flush()
    other.seen_since(0.0)
    kept = other.local.get("a")
    assert kept is not None and (kept.version, kept.rank) == (2, "r3")  # the poll's newer copy

    stale = Session("a", created=1.0, last_seen=5.0, rank="r1")  # an older version read late
    other.active.on_read("a", stale)  # type: ignore[misc]
    kept = other.local.get("a")
    assert kept is not None and kept.rank == "r3"
