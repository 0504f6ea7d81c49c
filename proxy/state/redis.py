"""The Redis state backend: session records, the prefix index and the response map shared by
every prefixgate replica, each with a local memory mirror that answers while Redis fails.

Session records live under ``{prefix}:``: ``s:{key}`` the record as JSON (expires ``retention``
seconds after its last save), ``b:{key}`` its breaks (a capped list, same expiry), ``seen`` a sorted
set of keys scored by last-seen time (active sessions are one ``ZRANGEBYSCORE`` away), ``d:{key}``
a session ended on purpose (``DELETE /admin/sessions``): a record Redis lacks without one was lost
(Redis restarted), and this replica's copy of it still stands.

The three stores share one ``RedisLink`` (``routing/redis_link.py``): one client that fails fast, one
circuit breaker. While Redis answers, the session table reads and writes it directly (one bounded
round trip each; replicas must see each other's records at once). The first failure opens the
circuit for all three: they answer from their mirrors without trying Redis again, and the link's
thread, never the event loop, probes it; before the circuit closes, each store pushes its mirror
back. For the session table that push keeps whichever record was seen last (a restarted, empty
Redis gets this replica's records back: sessions keep their turn counts and their rank).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson

from proxy.state.claims import RoomClaims
from proxy.state.load_share import LoadShare, RedisShare
from proxy.state.memory import MemorySessionStore
from proxy.state.redis_claims import RedisClaims
from proxy.state.redis_queue import RedisWaitOrder
from proxy.state.responses import RedisResponseRanks, ResponseRanks
from proxy.state.sessions import DEFAULT_RETENTION_S, MAX_BREAKS, Session, SessionStore
from proxy.state.wait_order import WaitOrder
from routing.index import PrefixIndex
from routing.index.redis_store import RedisPrefixIndex
from routing.redis_link import RedisLink, fail_fast_client
from routing.redis_topology import ScriptBatch, slot_prefix

log = logging.getLogger("prefixgate.sessions")

#: Records pushed back per round trip when Redis returns.
RESYNC_BATCH = 500

#: Push one record back unless Redis holds one seen later (another replica's) or the session was
#: ended meanwhile: the record, its ``seen`` entry and, when Redis has none, its breaks.
_PUSH = """
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
return 1
"""


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

    def get(self, key: str, *, breaks: bool = True) -> Session | None:
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
        self.local.save(session)

        def write() -> None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(self._ended_key(session.key))  # the same key begins a new session
            pipe.set(self._key(session.key), session.dumps(), px=self.retention_ms)
            pipe.zadd(self._seen, {session.key: session.last_seen})
            # idle past retention: the record has expired, its entry in ``seen`` goes too
            pipe.zremrangebyscore(self._seen, "-inf", session.last_seen - self.retention_s)
            pipe.execute()

        self.link.call(write)

    def delete(self, key: str) -> Session | None:
        found = self.get(key)
        self.local.delete(key)

        def remove() -> None:
            pipe = self.redis.pipeline(transaction=False)
            pipe.delete(self._key(key), self._breaks_key(key))
            pipe.zrem(self._seen, key)
            pipe.set(self._ended_key(key), 1, px=self.retention_ms)  # other replicas drop their copies
            pipe.execute()

        self.link.call(remove)
        return found

    def add_break(self, key: str, record: dict[str, Any]) -> bool:
        self.local.add_break(key, record)

        def append() -> bool:
            if not self.redis.exists(self._key(key)):
                return False
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(self._breaks_key(key), orjson.dumps(record))
            pipe.ltrim(self._breaks_key(key), -MAX_BREAKS, -1)
            pipe.pexpire(self._breaks_key(key), self.retention_ms)
            pipe.execute()
            return True

        appended = self.link.call(append)
        return appended if appended is not None else self.local.get(key) is not None

    def _load(self, keys: Any) -> list[Session]:
        """The records of ``keys`` (a Redis reply: a list of bytes)."""
        if not keys:
            return []
        raws = self.redis.mget([self._key(k.decode()) for k in keys])
        return [Session.loads(raw) for raw in raws if raw is not None]

    def seen_since(self, since: float) -> list[Session]:
        sessions = self.link.call(lambda: self._load(self.redis.zrangebyscore(self._seen, since, "+inf")))
        return sessions if sessions is not None else self.local.seen_since(since)

    def all(self) -> list[Session]:
        sessions = self.link.call(lambda: self._load(self.redis.zrange(self._seen, 0, -1)))
        return sessions if sessions is not None else self.local.all()

    def resync(self) -> None:
        """Push this replica's records back, each unless Redis holds one seen later (the link's
        thread, before the circuit closes). Raises on Redis errors."""
        records = self.local.all()  # a copy: the event loop may save meanwhile
        for start in range(0, len(records), RESYNC_BATCH):
            batch = ScriptBatch(self.redis)
            for session in records[start : start + RESYNC_BATCH]:
                key = session.key
                keys = [self._key(key), self._breaks_key(key), self._seen, self._ended_key(key)]
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


class RedisState:
    """The ``redis`` backend: state shared by every replica through the server at ``url``."""

    name = "redis"

    def __init__(self, url: str, timeout: float, index_ttl: float) -> None:
        self.url = url
        self.timeout = timeout
        self.index_ttl = index_ttl
        #: One client and one circuit breaker for every store on this Redis.
        self.link = RedisLink(fail_fast_client(url, timeout))
        self.client = self.link.client

    def sessions(self) -> SessionStore:
        return RedisSessionStore(self.url, socket_timeout=self.timeout, link=self.link)

    def response_ranks(self) -> ResponseRanks:
        return RedisResponseRanks(self.client, link=self.link)

    def claims(self, on_state: Callable[[bool], None]) -> RoomClaims:
        return RedisClaims(self.link, on_state=on_state)

    def wait_order(self, on_state: Callable[[bool], None]) -> WaitOrder:
        return RedisWaitOrder(self.link, on_state=on_state)

    def load_share(self) -> LoadShare:
        return RedisShare(self.link)

    def prefix_index(
        self, model: str, block_size: int, hash_algo: str, on_state: Callable[[bool], None]
    ) -> PrefixIndex:
        return RedisPrefixIndex(
            self.url,
            model=model,
            block_size=block_size,
            hash_algo=hash_algo,
            ttl_s=self.index_ttl,
            socket_timeout=self.timeout,
            on_state=on_state,
            link=self.link,
        )

    def close(self) -> None:
        self.link.close()
