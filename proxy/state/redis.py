"""The Redis state backend: session records, the prefix index and the response map shared by
every prefixgate replica, each with a local memory mirror that answers while Redis fails.

Session records live under ``{prefix}:``: ``s:{key}`` the record as JSON (expires ``retention``
seconds after its last save), ``b:{key}`` its breaks (a capped list, same expiry), ``seen`` a sorted
set of keys scored by last-seen time (active sessions are one ``ZRANGEBYSCORE`` away).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import orjson
import redis

from proxy.state.memory import MemorySessionStore
from proxy.state.responses import RedisResponseRanks, ResponseRanks
from proxy.state.sessions import DEFAULT_RETENTION_S, MAX_BREAKS, Session, SessionStore
from routing.index import PrefixIndex
from routing.index.redis_store import RedisPrefixIndex

log = logging.getLogger("prefixgate.sessions")


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
    ) -> None:
        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self.redis = client or redis.Redis.from_url(
            url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout
        )
        self.prefix = prefix
        self.retention_ms = int(retention_s * 1000)
        self.retention_s = retention_s
        self.local = MemorySessionStore()
        self.up = True

    def _key(self, key: str) -> str:
        return f"{self.prefix}:s:{key}"

    def _breaks_key(self, key: str) -> str:
        return f"{self.prefix}:b:{key}"

    @property
    def _seen(self) -> str:
        return f"{self.prefix}:seen"

    def _failed(self, exc: Exception) -> None:
        if self.up:
            log.warning("redis unreachable for the session table (%s): using this replica's records", exc)
        self.up = False

    def _ok(self) -> None:
        if not self.up:
            log.info("redis reachable again: session table shared again")
        self.up = True

    def get(self, key: str) -> Session | None:
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.get(self._key(key))
            pipe.lrange(self._breaks_key(key), 0, -1)
            raw, breaks = pipe.execute()
        except self._errors as exc:
            self._failed(exc)
            return self.local.get(key)
        self._ok()
        if raw is None:
            return None
        session = Session.loads(raw)
        session.breaks = [orjson.loads(b) for b in breaks]
        return session

    def save(self, session: Session) -> None:
        self.local.save(session)
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.set(self._key(session.key), session.dumps(), px=self.retention_ms)
            pipe.zadd(self._seen, {session.key: session.last_seen})
            # idle past retention: the record has expired, its entry in ``seen`` goes too
            pipe.zremrangebyscore(self._seen, "-inf", session.last_seen - self.retention_s)
            pipe.execute()
        except self._errors as exc:
            self._failed(exc)
            return
        self._ok()

    def delete(self, key: str) -> Session | None:
        found = self.get(key)
        self.local.delete(key)
        try:
            self.redis.delete(self._key(key), self._breaks_key(key))
            self.redis.zrem(self._seen, key)
        except self._errors as exc:
            self._failed(exc)
        return found

    def add_break(self, key: str, record: dict[str, Any]) -> bool:
        self.local.add_break(key, record)
        try:
            if not self.redis.exists(self._key(key)):
                return False
            pipe = self.redis.pipeline(transaction=False)
            pipe.rpush(self._breaks_key(key), orjson.dumps(record))
            pipe.ltrim(self._breaks_key(key), -MAX_BREAKS, -1)
            pipe.pexpire(self._breaks_key(key), self.retention_ms)
            pipe.execute()
        except self._errors as exc:
            self._failed(exc)
            return self.local.get(key) is not None
        return True

    def _load(self, keys: Any) -> list[Session]:
        """The records of ``keys`` (a Redis reply: a list of bytes)."""
        if not keys:
            return []
        raws = self.redis.mget([self._key(k.decode()) for k in keys])
        return [Session.loads(raw) for raw in raws if raw is not None]

    def seen_since(self, since: float) -> list[Session]:
        try:
            sessions = self._load(self.redis.zrangebyscore(self._seen, since, "+inf"))
        except self._errors as exc:
            self._failed(exc)
            return self.local.seen_since(since)
        self._ok()
        return sessions

    def all(self) -> list[Session]:
        try:
            sessions = self._load(self.redis.zrange(self._seen, 0, -1))
        except self._errors as exc:
            self._failed(exc)
            return self.local.all()
        self._ok()
        return sessions


class RedisState:
    """The ``redis`` backend: state shared by every replica through the server at ``url``."""

    name = "redis"

    def __init__(self, url: str, timeout: float, index_ttl: float) -> None:
        self.url = url
        self.timeout = timeout
        self.index_ttl = index_ttl
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)

    def sessions(self) -> SessionStore:
        return RedisSessionStore(self.url, socket_timeout=self.timeout, client=self.client)

    def response_ranks(self) -> ResponseRanks:
        return RedisResponseRanks(self.client)

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
        )

    def close(self) -> None:
        self.client.close()
