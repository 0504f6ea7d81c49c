"""The session records active in Redis, re-read only where they changed.

Admission counts the active sessions every poll (``Admission.refresh``, every 10-250 ms), and reading
every active record from Redis each time (a sorted-set range, then every record, parsed) made the
poll O(sessions): with 256 sessions it was a sixth of the event loop's time (py-spy, the
workers investigation in docs/investigations.md).
So every script that writes a record also logs it: ``{prefix}:changes`` is a sorted set of session
keys scored by a write counter (``{prefix}:counters`` field ``seq``), one entry per key, its last
write. ``ActiveRecords`` keeps the records it read and, at each poll, reads the keys logged since its
cursor and those records only.

Invariants, between two ``read`` calls:

- every record in Redis last seen at or after ``horizon`` is in ``records``, as it was when the
  write numbered ``cursor`` had been made (or later);
- a key written after that has an entry in ``changes`` scored above ``cursor``, unless the log was
  trimmed past it (``counters`` field ``trimmed``: the highest score dropped) or Redis lost it (a
  restart or a flush: the counters were born again, field ``born``, or the link resynced): either
  reads everything again.

Each record read is also handed to ``on_read`` (None for one ended or expired): the session table
keeps other replicas' records in its mirror (``mirror_into``), so a replica that never served a
session still knows its rank while Redis is down, and pushes it back into a Redis that restarted
empty even when the replica that served it is gone.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from proxy.state.memory import MemorySessionStore
from proxy.state.sessions import Session

#: Told of each record a read found (the key, the record, or None: it ended or expired).
OnRead = Callable[[str, Session | None], None]

#: Keys kept in the change log (one entry per key; past it the least recently written go, and a
#: replica whose cursor is older reads every active record again).
CHANGES_KEPT = 100_000
#: Entries past ``CHANGES_KEPT`` before the log is trimmed (a trim per that many writes at most).
TRIM_SLACK = 1_000


def mark(counters: int, changes: int, member: str, kept: int = CHANGES_KEPT, slack: int = TRIM_SLACK) -> str:
    """The Lua that logs a write of the record of session ``member`` (a Lua expression), where
    ``KEYS[counters]`` and ``KEYS[changes]`` are the store's counters and change log; past
    ``kept + slack`` entries the log keeps its newest ``kept``."""
    return f"""
local seq = redis.call('HINCRBY', KEYS[{counters}], 'seq', 1)
if seq == 1 then
  local now = redis.call('TIME')
  redis.call('HSET', KEYS[{counters}], 'born', now[1] .. '.' .. now[2])
end
redis.call('ZADD', KEYS[{changes}], seq, {member})
local logged = redis.call('ZCARD', KEYS[{changes}])
if logged > {kept + slack} then
  local last = logged - {kept} - 1
  local cut = redis.call('ZRANGE', KEYS[{changes}], last, last, 'WITHSCORES')
  redis.call('ZREMRANGEBYRANK', KEYS[{changes}], 0, last)
  redis.call('HSET', KEYS[{counters}], 'trimmed', cut[2])
end
"""


class ActiveRecords:
    """The records last seen since a time, read whole once and then only where they changed (see
    the module docstring for its invariants). ``read`` raises Redis's errors; it is safe from any
    thread (one read at a time)."""

    def __init__(
        self,
        client: Any,
        record_key: Callable[[str], str],
        seen: str,
        counters: str,
        changes: str,
        on_read: OnRead | None = None,
    ) -> None:
        self.client = client
        self.on_read = on_read
        self.record_key = record_key
        self.seen = seen
        self.counters = counters
        self.changes = changes
        self.records: dict[str, Session] = {}
        self.horizon: float | None = None  # None: nothing read yet
        self.cursor = 0
        self.born: bytes | None = None
        self.epoch: int | None = None
        self.whole_reads = 0
        self._lock = threading.Lock()

    def read(self, since: float, epoch: int) -> list[Session]:
        """The records last seen at or after ``since``; ``epoch`` changes when Redis may have lost
        writes (the link's resync count): everything is read again."""
        with self._lock:
            if self.horizon is None or since < self.horizon or epoch != self.epoch or not self._update():
                self._read_whole(since)
                self.epoch = epoch
            records = self.records
            for key in [k for k, s in records.items() if s.last_seen < since]:
                del records[key]
            self.horizon = since
            return list(records.values())

    def _read_whole(self, since: float) -> None:
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.counters, ["seq", "born"])  # first: what is written after is read next time
        pipe.zrangebyscore(self.seen, since, "+inf")
        (seq, self.born), keys = pipe.execute()
        self.records = {s.key: s for s in self.load(keys)}
        if self.on_read is not None:
            for session in sorted(self.records.values(), key=lambda s: s.last_seen):
                self.on_read(session.key, session)
        self.cursor = int(seq or 0)
        self.whole_reads += 1

    def _update(self) -> bool:
        """Read the records written since ``cursor``; False when the log cannot say which."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hmget(self.counters, ["seq", "trimmed", "born"])
        pipe.zrangebyscore(self.changes, f"({self.cursor}", "+inf", withscores=True)
        (seq, trimmed, born), changed = pipe.execute()
        if born != self.born or int(seq or 0) < self.cursor or int(float(trimmed or 0)) > self.cursor:
            return False
        if not changed:
            return True
        keys = [k.decode() for k, _ in changed]
        records = self.records
        for key, raw in zip(keys, self._raws(keys), strict=True):
            session = None if raw is None else Session.loads(raw)  # None: ended, or expired
            if session is None:
                records.pop(key, None)
            else:
                records[key] = session
            if self.on_read is not None:
                self.on_read(key, session)
        self.cursor = max(self.cursor, int(changed[-1][1]))
        return True

    def load(self, keys: Any) -> list[Session]:
        """The records Redis holds of ``keys`` (session keys as a Redis reply gives them: bytes)."""
        return [Session.loads(raw) for raw in self._raws([k.decode() for k in keys]) if raw is not None]

    def _raws(self, keys: list[str]) -> list[bytes | None]:
        """The stored records of session ``keys``, None where Redis holds none (one round trip)."""
        if not keys:
            return []
        raws: list[bytes | None] = self.client.mget([self.record_key(k) for k in keys])
        return raws


def mirror_into(local: MemorySessionStore, unlanded: Callable[[str], bool]) -> OnRead:
    """An ``on_read`` that keeps what a read found in ``local``: a record of a later version than
    the copy there, and a record's end (unless this replica's own save of the key has not landed
    yet, ``unlanded``: it will begin the session again)."""

    def keep(key: str, session: Session | None) -> None:
        kept = local.get(key)
        if session is None:
            if kept is not None and not unlanded(key):
                local.delete(key)
        elif kept is None or kept.version < session.version:
            local.save(session)

    return keep
