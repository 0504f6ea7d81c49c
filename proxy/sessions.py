"""The session table: what prefixgate knows about each conversation, in memory or in Redis.

One record per session key (``proxy/session_id.py``): the rank it lives on, when it was created and
last seen, its turns, its current context (tokens and blocks: its KV working set, which admission
counts against the rank's pool), the prompt tokens it sent, the hit tokens prefixgate estimated and
the ranks reported, the prefill the ranks computed, its prefix breaks (``add_break``, fed by the
prefix-break explainer) and the label of its client's API key.

Times are wall-clock seconds (``time.time()``) so replicas sharing one Redis agree on them.

Redis layout (``{prefix}:``): ``s:{key}`` the record as JSON (expires ``retention`` seconds after
its last save), ``b:{key}`` its breaks (a capped list, same expiry), ``seen`` a sorted set of keys
scored by last-seen time (active sessions are one ``ZRANGEBYSCORE`` away). Every save is mirrored in
a local memory store; while Redis fails, the table answers from that mirror and logs it once.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

import orjson

log = logging.getLogger("prefixgate.sessions")

#: Records kept per store at most (memory): past it the least recently seen session is dropped.
DEFAULT_MAX_SESSIONS = 100_000
#: Seconds an idle session's record is kept (Redis expiry; the memory store keeps ``max_sessions``).
DEFAULT_RETENTION_S = 86_400.0
#: A record is saved at most this many seconds after its ``last_seen`` (between admission and the
#: router's pick); the memory store relies on it to find the active sessions without a full scan.
MAX_SAVE_LAG_S = 60.0
#: Break records kept per session (the newest).
MAX_BREAKS = 50
#: The fleet hit rate is computed over this many most recent requests, as vLLM's log line does.
HIT_RATE_WINDOW = 1000

SORT_FIELDS = frozenset(
    {
        "key",
        "rank",
        "created",
        "last_seen",
        "turns",
        "context_tokens",
        "prompt_tokens_sent",
        "hit_tokens_estimated",
        "hit_tokens_reported",
        "prefill_tokens",
        "hit_rate",
        "client",
    }
)


@dataclass(slots=True)
class Session:
    """One conversation as prefixgate sees it."""

    key: str
    created: float
    last_seen: float
    rank: str | None = None
    turns: int = 0
    context_tokens: int = 0
    context_blocks: int = 0
    prompt_tokens_sent: int = 0
    hit_tokens_estimated: int = 0
    hit_tokens_reported: int = 0
    prefill_tokens: int = 0
    client: str | None = None
    #: When the rank last answered it (wall clock); below ``last_seen``: a request is in flight.
    answered_at: float = 0.0
    #: Think gaps observed (answer to next request) and the longest of them, in seconds.
    gaps: int = 0
    gap_max: float = 0.0
    #: The leading system+tools prefix other sessions of the same agent share, as the rank caches it
    #: (key: the hash of its last full block, hex); a rank holds it once whatever its sessions.
    head_key: str | None = None
    head_tokens: int = 0
    #: Ended by admission (idle past its own think times while a new session needed its room).
    released: bool = False
    breaks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def hit_rate(self) -> float | None:
        """Reported hit tokens over prompt tokens sent (None before the first answer)."""
        return self.hit_tokens_reported / self.prompt_tokens_sent if self.prompt_tokens_sent else None

    def is_active(self, now: float, idle_ttl: float) -> bool:
        return not self.released and now - self.last_seen <= idle_ttl

    @property
    def answered(self) -> bool:
        """Its latest request has been answered (none in flight)."""
        return self.answered_at >= self.last_seen

    def note_request(self, now: float) -> float | None:
        """A new request of this session: its think gap (answer to this request) joins the observed
        ones, and is returned (None when the previous request is unanswered or there was none)."""
        gap = None
        if self.answered and self.answered_at:
            gap = now - self.answered_at
            self.gaps += 1
            if gap > self.gap_max:
                self.gap_max = gap
        self.last_seen = now
        return gap

    def to_dict(self, with_breaks: bool = True) -> dict[str, Any]:
        data = asdict(self)
        data["hit_rate"] = self.hit_rate
        if not with_breaks:
            data["breaks"] = len(self.breaks)
        return data

    def dumps(self) -> bytes:
        """The record without its breaks (stored apart, so appending one never rewrites the record)."""
        data = asdict(self)
        del data["breaks"]
        return orjson.dumps(data)

    @classmethod
    def loads(cls, raw: bytes | str) -> Session:
        data = orjson.loads(raw)
        return cls(**{k: data[k] for k in _FIELDS if k in data})


_FIELDS = tuple(f.name for f in fields(Session) if f.name != "breaks")


class SessionStore(Protocol):
    """Where session records live. Calls are synchronous and short (the event loop makes them)."""

    def get(self, key: str) -> Session | None: ...

    def save(self, session: Session) -> None: ...

    def delete(self, key: str) -> Session | None: ...

    def add_break(self, key: str, record: dict[str, Any]) -> bool: ...

    def seen_since(self, since: float) -> list[Session]:
        """Sessions last seen at or after ``since`` (the active ones, for a given idle TTL)."""
        ...

    def all(self) -> list[Session]: ...


class MemorySessionStore:
    """Records in a dict ordered by last save (the most recent last), bounded by ``max_sessions``."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._by_key: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: str) -> Session | None:
        return self._by_key.get(key)

    def save(self, session: Session) -> None:
        self._by_key[session.key] = session
        self._by_key.move_to_end(session.key)
        while len(self._by_key) > self.max_sessions:
            self._by_key.popitem(last=False)

    def delete(self, key: str) -> Session | None:
        return self._by_key.pop(key, None)

    def add_break(self, key: str, record: dict[str, Any]) -> bool:
        session = self._by_key.get(key)
        if session is None:
            return False
        session.breaks.append(record)
        del session.breaks[:-MAX_BREAKS]
        return True

    def seen_since(self, since: float) -> list[Session]:
        # the dict is in save order, which is last-seen order but for records saved up to
        # MAX_SAVE_LAG after their last_seen: walk back from the newest save until that far past
        out = []
        stop = since - MAX_SAVE_LAG_S
        for session in reversed(self._by_key.values()):
            if session.last_seen >= since:
                out.append(session)
            elif session.last_seen < stop:
                break
        return out

    def all(self) -> list[Session]:
        return list(self._by_key.values())


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
        import redis

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

    def _load(self, keys: list[bytes]) -> list[Session]:
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


class HitRateWindow:
    """Hit tokens over queried tokens across the most recent ``size`` requests (vLLM's log line)."""

    def __init__(self, size: int = HIT_RATE_WINDOW) -> None:
        self._window: deque[tuple[int, int]] = deque(maxlen=size)
        self.queried = 0
        self.hits = 0

    def add(self, queried: int, hits: int) -> None:
        window = self._window
        if len(window) == window.maxlen:
            old_queried, old_hits = window[0]
            self.queried -= old_queried
            self.hits -= old_hits
        window.append((queried, hits))
        self.queried += queried
        self.hits += hits

    @property
    def rate(self) -> float:
        return self.hits / self.queried if self.queried else 0.0

    def __len__(self) -> int:
        return len(self._window)


@dataclass(frozen=True, slots=True)
class Page:
    total: int
    sessions: list[Session]


class SessionTable:
    """The session records behind one interface, whichever store holds them."""

    def __init__(
        self, store: SessionStore, idle_ttl: float, clock: Callable[[], float] | None = None
    ) -> None:
        self.store = store
        self.idle_ttl = idle_ttl
        self.clock = clock or time.time
        self.fleet = HitRateWindow()

    @classmethod
    def from_settings(
        cls, redis_url: str | None, idle_ttl: float, redis_timeout: float = 0.25
    ) -> SessionTable:
        store: SessionStore = (
            RedisSessionStore(redis_url, socket_timeout=redis_timeout) if redis_url else MemorySessionStore()
        )
        return cls(store, idle_ttl)

    def get(self, key: str) -> Session | None:
        return self.store.get(key)

    def save(self, session: Session) -> None:
        self.store.save(session)

    def delete(self, key: str) -> Session | None:
        return self.store.delete(key)

    def add_break(self, session_key: str, record: dict[str, Any]) -> bool:
        """Append a prefix-break record (``proxy/explain.py``) to a session; False if it is unknown."""
        return self.store.add_break(session_key, record)

    def active(self, now: float | None = None) -> list[Session]:
        """Sessions seen within the idle TTL and not released."""
        now = self.clock() if now is None else now
        return [s for s in self.store.seen_since(now - self.idle_ttl) if not s.released]

    def page(
        self,
        *,
        sort: str = "last_seen",
        descending: bool = True,
        offset: int = 0,
        limit: int = 50,
        active_only: bool = False,
        client: str | None = None,
    ) -> Page:
        """A sorted, paginated slice of the table (``client``: only that client's sessions)."""
        if sort not in SORT_FIELDS:
            raise ValueError(f"cannot sort by {sort!r}: one of {', '.join(sorted(SORT_FIELDS))}")
        rows = self.active() if active_only else self.store.all()
        if client is not None:
            rows = [s for s in rows if s.client == client]

        def sort_key(s: Session) -> tuple[bool, Any]:
            value = getattr(s, sort)
            missing = value is None or (isinstance(value, float) and math.isnan(value))
            # missing values last whichever the direction
            return (not missing if descending else missing, value if not missing else 0)

        rows.sort(key=sort_key, reverse=descending)
        return Page(len(rows), rows[offset : offset + limit])
