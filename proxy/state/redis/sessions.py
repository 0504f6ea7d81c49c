"""The Redis state backend: session records, the prefix index and the response map shared by
every prefixgate replica, each with a local memory mirror that answers while Redis fails.

Session records live under ``{prefix}:``: ``s:{key}`` the record as JSON (expires ``retention``
seconds after its last save), ``b:{key}`` its breaks (a capped list, same expiry), ``seen`` a sorted
set of keys scored by last-seen time (active sessions are one ``ZRANGEBYSCORE`` away), ``d:{key}``
a session ended on purpose (``DELETE /admin/sessions``): a record Redis lacks without one was lost
(Redis restarted), and this replica's copy of it still stands.

The three stores share one ``RedisLink`` (``proxy/state/redis/link.py``): one client that fails fast, one
circuit breaker. While Redis answers, the session table reads it directly (one bounded round trip:
replicas must see each other's records) and writes it behind, through the link's thread, in order:
a save is two of a turn's round trips, and the event loop served nothing while it waited on them.
A write behind is seen by other replicas a queue's wait later; this replica reads its own records
from its mirror until they have landed (``get``, ``seen_since``). Each save carries the record's
``version`` and lands only over an older one (``_SAVE``): a settlement that lands after another
replica saved the session's next turn is dropped, not written over it (the next turn keeps its
place; the late turn's usage counters are what is lost). The first failure opens the circuit for
all three: they answer from their mirrors without trying Redis again, and the link's thread, never
the event loop, probes it; before the circuit closes, each store pushes its mirror back. The session
table's mirror holds every record its polls read, other replicas' too, and its push keeps whichever
record was seen last: a restarted, empty Redis gets every record back, a dead replica's included.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import orjson

from proxy.state.memory import MemorySessionStore
from proxy.state.redis.changes import ActiveRecords, mark, mirror_into
from proxy.state.redis.link import RedisLink, fail_fast_client
from proxy.state.redis.topology import ScriptBatch, slot_prefix
from proxy.state.sessions import DEFAULT_RETENTION_S, MAX_BREAKS, Session

log = logging.getLogger("prefixgate.sessions")

#: Records pushed back per round trip when Redis returns.
RESYNC_BATCH = 500

#: Save one record unless Redis holds a newer version of it (a later save, by another replica; at
#: the same version, more turns; counted in the counters' ``superseded``): the record, its ``seen``
#: entry, and ``seen`` pruned of records idle past retention (expired: their entries go too). The
#: same key saved begins a new session: an ended mark goes.
_SAVE = (
    """
local current = redis.call('GET', KEYS[1])
if current then
  local stored = cjson.decode(current)
  local version, mine = tonumber(stored['version']) or 0, tonumber(ARGV[2])
  if version > mine or (version == mine and (tonumber(stored['turns']) or 0) > tonumber(ARGV[3])) then
    redis.call('HINCRBY', KEYS[4], 'superseded', 1)
    return 0
  end
end
redis.call('DEL', KEYS[3])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[4])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[6])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[7])
"""
    + mark(4, 5, "ARGV[6]")
    + """
return 1
"""
)

#: Keys this replica wrote behind remembered at most (past it, the landed ones are forgotten).
PENDING_KEPT = 4096

#: Push one record back unless Redis holds one seen later (another replica's) or the session was
#: ended meanwhile: the record, its ``seen`` entry and, when Redis has none, its breaks.
_PUSH = (
    """
if redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
local current = redis.call('GET', KEYS[1])
if current then
  local seen = cjson.decode(current)['last_seen']
  if seen and tonumber(seen) > tonumber(ARGV[2]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[4])
if #ARGV > 4 and redis.call('EXISTS', KEYS[2]) == 0 then
  for i = 5, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
end
"""
    + mark(5, 6, "ARGV[4]")
    + """
return 1
"""
)

#: End a session (``delete``): its record, breaks and ``seen`` entry go, a mark that it ended stays
#: (other replicas drop their copies).
_END = """
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('SET', KEYS[4], 1, 'PX', ARGV[2])
""" + mark(5, 6, "ARGV[1]")


class RedisSessionStore:
    """Records in Redis, shared by every replica; a local memory mirror answers while Redis fails."""

    def __init__(
        self,
        url: str,
        *,
        prefix: str = "prefixgate:sessions",
        retention_s: float = DEFAULT_RETENTION_S,
        socket_timeout: float = 0.25,
        client: Any = None,
        link: RedisLink | None = None,
    ) -> None:
        """``link``: the one shared with the other stores on this Redis (None: one of its own, over
        ``client`` or a new client of ``url``)."""
        self._owns_link = link is None
        self.link = link or RedisLink(
            client or fail_fast_client(url, socket_timeout), name="redis session table"
        )
        self.redis = self.link.client
        self.prefix = slot_prefix(prefix, self.redis)  # the push script touches four of its keys
        self.retention_ms = int(retention_s * 1000)
        self.retention_s = retention_s
        self.local = MemorySessionStore()
        self._push = self.redis.register_script(_PUSH)
        self._save = self.redis.register_script(_SAVE)
        self._end = self.redis.register_script(_END)
        self._counters = f"{self.prefix}:counters"
        self._changes = f"{self.prefix}:changes"
        keep = mirror_into(self.local, self._unlanded)  # other replicas' records too, as polls read them
        self.active = ActiveRecords(self.redis, self._key, self._seen, self._counters, self._changes, keep)
        #: Sequence numbers of the writes behind: the last submitted (event loop), the last run (the
        #: link's thread, in submission order), and each key's last submitted. A key whose last
        #: write has not run is read from the mirror.
        self._submitted = 0
        self._written = 0
        self._pending: dict[str, int] = {}
        #: Saves of this replica Redis dropped for a later version of the record (that turn's usage
        #: counters lost): counted where they land, on the link's thread.
        self.dropped_saves = 0
        self._pending_lock = threading.Lock()
        self.link.on_resync(self.resync)

    @property
    def up(self) -> bool:
        return self.link.up

    def _key(self, key: str) -> str:
        return f"{self.prefix}:s:{key}"

    def _breaks_key(self, key: str) -> str:
        return f"{self.prefix}:b:{key}"

    def _ended_key(self, key: str) -> str:
        return f"{self.prefix}:d:{key}"

    @property
    def _seen(self) -> str:
        return f"{self.prefix}:seen"

    def _script_keys(self, key: str) -> list[str]:
        """The keys of ``_PUSH`` and ``_END`` for session ``key``, in their order."""
        return [
            self._key(key),
            self._breaks_key(key),
            self._seen,
            self._ended_key(key),
            self._counters,
            self._changes,
        ]

    def _behind(self, key: str, write: Callable[[], object]) -> None:
        """``write`` on the link's thread, after every write submitted before it; ``key`` is read
        from the mirror until it has run (a write the link skips while Redis is unreachable leaves
        its key read from the mirror until a later write runs: the mirror is what Redis gets back)."""
        with self._pending_lock:
            self._submitted += 1
            sequence = self._submitted
            self._pending[key] = sequence
            if len(self._pending) > PENDING_KEPT:
                self._forget_landed()

        def task() -> None:
            try:
                write()
            finally:
                self._written = sequence

        self.link.submit(task)

    def _forget_landed(self) -> None:
        """Drop the keys whose last write behind has run (under ``_pending_lock``)."""
        written = self._written
        self._pending = {k: n for k, n in self._pending.items() if n > written}

    def _unwritten(self) -> set[str]:
        """The keys whose last write behind has not run yet (the landed ones are forgotten here, so
        each poll looks at the writes still queued, not at every key written since the last prune)."""
        with self._pending_lock:
            self._forget_landed()
            return set(self._pending)

    def _with_unwritten(
        self, found: list[Session], unwritten: set[str], since: float | None
    ) -> list[Session]:
        """``found`` in Redis, with this replica's writes not landed yet in place of what Redis
        holds of those keys (``unwritten``, taken before Redis was read: a write landing during the
        read is then in the mirror, not missed by both; ``since``: only records seen from then on)."""
        if not unwritten:
            return found
        out = [s for s in found if s.key not in unwritten]
        for key in unwritten:
            session = self.local.get(key)
            if session is not None and (since is None or session.last_seen >= since):
                out.append(session)
        return out

    def _unlanded(self, key: str) -> bool:
        """Whether this replica's last write of ``key`` has not run yet (the mirror has it)."""
        sequence = self._pending.get(key)
        return sequence is not None and sequence > self._written

    def get(self, key: str, *, breaks: bool = True) -> Session | None:
        if self._unlanded(key):
            return self.local.get(key)

        def fetch() -> tuple[Any, Any, Any]:
            pipe = self.redis.pipeline(transaction=False)
            pipe.get(self._key(key))
            pipe.exists(self._ended_key(key))
            if breaks:
                pipe.lrange(self._breaks_key(key), 0, -1)
            raw, ended, *records = pipe.execute()
            return raw, ended, records[0] if records else []

        found = self.link.call(fetch)
        if found is None:
            return self.local.get(key)
        raw, ended, records = found
        if raw is None:
            if ended:  # ended by another replica: so it is here
                self.local.delete(key)
                return None
            return self.local.get(key)  # lost by Redis (a restart), not ended: this replica's copy
        session = Session.loads(raw)
        session.breaks = [orjson.loads(b) for b in records]
        return session

    def save(self, session: Session) -> None:
        kept = self.local.get(session.key)
        if kept is not None and not session.breaks:  # read without them: the copy Redis falls back on
            session.breaks = kept.breaks  # keeps this replica's (``resync`` pushes them back)
        session.version += 1
        self.local.save(session)
        key = session.key
        keys = [self._key(key), self._seen, self._ended_key(key), self._counters, self._changes]
        args: list[bytes | str | int] = [
            session.dumps(),  # now: the session changes on after this call returns
            session.version,
            session.turns,
            self.retention_ms,
            repr(session.last_seen),
            key,
            repr(session.last_seen - self.retention_s),
        ]
        self._behind(key, lambda: self._count_dropped(self._save(keys=keys, args=args)))

    def _count_dropped(self, landed: object) -> None:
        """On the link's thread: the save script answers 0 when it dropped the save for a later one."""
        if landed == 0:
            self.dropped_saves += 1

    def delete(self, key: str) -> Session | None:
        found = self.get(key)
        self.local.delete(key)

        keys = self._script_keys(key)
        args: list[str | int] = [key, self.retention_ms]
        # behind, after this replica's saves of it, which would revive it
        self._behind(key, lambda: self._end(keys=keys, args=args))
        return found

    def add_break(self, key: str, record: dict[str, Any]) -> bool:
        if self.local.add_break(key, record):  # saved here: appended behind, after the save
            self._behind(key, lambda: self._append_break(key, record))
            return True
        appended = self.link.call(lambda: self._append_break(key, record))
        return appended if appended is not None else False

    def _append_break(self, key: str, record: dict[str, Any]) -> bool:
        """Append ``record`` to the breaks of a session Redis holds; False if it holds none."""
        if not self.redis.exists(self._key(key)):
            return False
        pipe = self.redis.pipeline(transaction=False)
        pipe.rpush(self._breaks_key(key), orjson.dumps(record))
        pipe.ltrim(self._breaks_key(key), -MAX_BREAKS, -1)
        pipe.pexpire(self._breaks_key(key), self.retention_ms)
        pipe.execute()
        return True

    def seen_since(self, since: float) -> list[Session]:
        unwritten = self._unwritten()
        sessions = self.link.call(lambda: self.active.read(since, self.link.resyncs))
        if sessions is None:
            return self.local.seen_since(since)
        return self._with_unwritten(sessions, unwritten, since)

    def all(self) -> list[Session]:
        unwritten = self._unwritten()
        sessions = self.link.call(lambda: self.active.load(self.redis.zrange(self._seen, 0, -1)))
        return self._with_unwritten(sessions, unwritten, None) if sessions is not None else self.local.all()

    def resync(self) -> None:
        """Push this replica's records back, each unless Redis holds one seen later (the link's
        thread, before the circuit closes). Raises on Redis errors."""
        records = self.local.all()  # a copy: the event loop may save meanwhile
        for start in range(0, len(records), RESYNC_BATCH):
            batch = ScriptBatch(self.redis)
            for session in records[start : start + RESYNC_BATCH]:
                key = session.key
                keys = self._script_keys(key)
                breaks = [orjson.dumps(b) for b in session.breaks[-MAX_BREAKS:]]
                args: list[bytes | str | int] = [
                    session.dumps(),
                    repr(session.last_seen),
                    self.retention_ms,
                    session.key,
                    *breaks,
                ]
                self._push(keys=keys, args=args, client=batch.target)
            batch.execute()
        if records:
            log.info("session table: %d records of this replica pushed back to Redis", len(records))

    def close(self) -> None:
        if self._owns_link:
            self.link.close()
