"""The session table's stores (memory and a real Redis) behind one interface."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from proxy.ops.dashboard import HitRateWindow
from proxy.state.memory import MemorySessionStore
from proxy.state.redis.sessions import RedisSessionStore
from proxy.state.sessions import MAX_BREAKS, Session, SessionStore, SessionTable
from tests.routing.conftest import RedisServer


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[SessionStore]:
    if request.param == "memory":
        yield MemorySessionStore()
        return
    server = RedisServer().start()
    try:
        yield RedisSessionStore(server.url, socket_timeout=1.0)
    finally:
        server.stop()


def test_save_get_delete_round_trip(store: SessionStore) -> None:
    s = Session("k1", created=100.0, last_seen=101.0, rank="r0", turns=3, context_tokens=700, client="c")
    store.save(s)
    got = store.get("k1")
    assert got is not None
    assert (got.rank, got.turns, got.context_tokens, got.client) == ("r0", 3, 700, "c")
    assert store.delete("k1") is not None
    assert store.get("k1") is None
    assert store.delete("k1") is None


def test_seen_since_returns_only_active_sessions(store: SessionStore) -> None:
    for n, seen in enumerate((10.0, 20.0, 30.0)):
        store.save(Session(f"k{n}", created=seen, last_seen=seen))
    assert {s.key for s in store.seen_since(15.0)} == {"k1", "k2"}
    store.save(Session("k0", created=10.0, last_seen=40.0))  # k0 comes back
    assert {s.key for s in store.seen_since(25.0)} == {"k0", "k2"}
    assert {s.key for s in store.all()} == {"k0", "k1", "k2"}


def test_breaks_append_capped_and_only_for_known_sessions(store: SessionStore) -> None:
    assert store.add_break("ghost", {"at": 1}) is False
    store.save(Session("k", created=1.0, last_seen=1.0))
    for n in range(MAX_BREAKS + 5):
        assert store.add_break("k", {"n": n})
    got = store.get("k")
    assert got is not None
    assert [b["n"] for b in got.breaks] == list(range(5, MAX_BREAKS + 5))


def test_a_read_without_breaks_and_its_save_keep_the_breaks(store: SessionStore) -> None:
    """Admission reads a record without its breaks and saves it back: the breaks stay, in the store
    and in the copy a Redis store falls back on (and pushes back after a restart)."""
    store.save(Session("k", created=1.0, last_seen=1.0))
    store.add_break("k", {"n": 1})
    bare = store.get("k", breaks=False)
    assert bare is not None and bare.turns == 0
    bare.turns = 2
    store.save(bare)
    got = store.get("k")
    assert got is not None and got.turns == 2 and [b["n"] for b in got.breaks] == [1]
    if isinstance(store, RedisSessionStore):
        kept = store.local.get("k")
        assert kept is not None and [b["n"] for b in kept.breaks] == [1]


def test_redis_store_falls_back_to_its_local_records_when_redis_dies() -> None:
    server = RedisServer().start()
    store = RedisSessionStore(server.url, socket_timeout=0.2)
    store.save(Session("k", created=1.0, last_seen=5.0, context_tokens=10))
    server.stop()
    got = store.get("k")
    assert got is not None and got.context_tokens == 10
    assert [s.key for s in store.seen_since(1.0)] == ["k"]
    assert store.up is False


def test_table_page_sorts_missing_values_last() -> None:
    table = SessionTable(MemorySessionStore(), idle_ttl=10, clock=lambda: 100.0)
    table.save(Session("a", created=1, last_seen=95, prompt_tokens_sent=100, hit_tokens_reported=50))
    table.save(Session("b", created=1, last_seen=96))  # no answer yet: no hit rate
    table.save(Session("c", created=1, last_seen=50, prompt_tokens_sent=100, hit_tokens_reported=90))
    assert [s.key for s in table.page(sort="hit_rate").sessions] == ["c", "a", "b"]
    assert [s.key for s in table.page(sort="hit_rate", descending=False).sessions] == ["a", "c", "b"]
    assert [s.key for s in table.page(active_only=True).sessions] == ["b", "a"]
    with pytest.raises(ValueError):
        table.page(sort="password")


def test_hit_rate_window_keeps_the_last_requests_only() -> None:
    window = HitRateWindow(size=3)
    for queried, hits in ((100, 0), (100, 100), (100, 50), (100, 100)):
        window.add(queried, hits)
    assert len(window) == 3
    assert window.rate == pytest.approx(250 / 300)


def test_a_record_dumps_every_field_but_its_breaks_as_a_deep_copy_would() -> None:
    """``dumps`` writes the fields as they are (no ``asdict`` copy): the same bytes as the deep copy
    without its breaks, nested decision records included, and ``loads`` restores every field."""
    from dataclasses import asdict

    import orjson

    s = Session("k2", created=1.0, last_seen=2.5, rank="r1", turns=4, gaps=2, gap_max=3.25, head_key="ab")
    s.admission = {"decision": "admitted", "allowed": ["r0", "r1"], "options": [{"rank": "r0", "cost": 1.5}]}
    s.breaks = [{"turn": 1, "cause": "tools"}]
    reference = asdict(s)
    del reference["breaks"]
    assert s.dumps() == orjson.dumps(reference)
    back = Session.loads(s.dumps())
    assert back.breaks == []
    back.breaks = s.breaks
    assert back == s
