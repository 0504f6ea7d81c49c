"""The session table: what prefixgate knows about each conversation, whichever store holds it.

One record per session key (``proxy/stages/identify.py``): the rank it lives on, when it was
created and last seen, its turns, its current context (tokens and blocks: its KV working set, which
admission counts against the rank's pool), the prompt tokens it sent, the hit tokens prefixgate
estimated and the ranks reported, the prefill the ranks computed, its prefix breaks (``add_break``,
fed by the prefix-break explainer) and the label of its client's API key.

Times are wall-clock seconds (``time.time()``) so replicas sharing one Redis agree on them. The
stores are ``proxy/state/memory.py`` and ``proxy/state/redis/sessions.py``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

import orjson

#: Records kept per store at most (memory): past it the least recently seen session is dropped.
DEFAULT_MAX_SESSIONS = 100_000
#: Seconds an idle session's record is kept (Redis expiry; the memory store keeps ``max_sessions``).
DEFAULT_RETENTION_S = 86_400.0
#: A record is saved at most this many seconds after its ``last_seen`` (between admission and the
#: router's pick); the memory store relies on it to find the active sessions without a full scan.
MAX_SAVE_LAG_S = 60.0
#: Break records kept per session (the newest).
MAX_BREAKS = 50

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
    #: Think gaps observed (answer to next request), the longest and the latest of them, in seconds.
    gaps: int = 0
    gap_max: float = 0.0
    gap_last: float = 0.0
    #: Seconds its latest answered request took from arrival to last byte, 0 when it waited for
    #: admission: what requests take, read from the table by every replica (``admission/gate.py``).
    served_s: float = 0.0
    #: The leading system+tools prefix other sessions of the same agent share, as the rank caches it
    #: (key: the hash of its last full block, hex); a rank holds it once whatever its sessions.
    head_key: str | None = None
    head_tokens: int = 0
    #: Without a seat: ended by admission (quiet past its own think times while a new session needed
    #: its room), or parked for a waiter (``parks`` counts those); its next turn waits for a seat.
    released: bool = False
    #: When it last took a seat (wall clock): a seat just given is not taken back (``rotation.py``).
    seated_at: float = 0.0
    parks: int = 0
    #: Its priority class when it took its seat: a higher class's waiter parks a lower one first.
    priority: int = 0
    #: Admission's last decision for it (``proxy/admission/explain.py``): why it waited, where it went.
    admission: dict[str, Any] | None = None
    #: Saves of this record, whichever replica made them: a shared store keeps the newest version,
    #: so a replica's write that lands late never overwrites a later turn saved by another one.
    version: int = 0
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
            self.gap_last = gap
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
        """The record without its breaks (stored apart, so appending one never rewrites the record).

        Its fields as they are, not ``asdict``'s deep copy: orjson writes nested dicts, lists and
        dataclasses itself, and the copy (breaks included, then dropped) cost more than the round
        trip that saves the record, twice a turn with Redis."""
        return orjson.dumps({name: getattr(self, name) for name in _FIELDS})

    @classmethod
    def loads(cls, raw: bytes | str) -> Session:
        data = orjson.loads(raw)
        return cls(**{k: data[k] for k in _FIELDS if k in data})


_FIELDS = tuple(f.name for f in fields(Session) if f.name != "breaks")


class SessionStore(Protocol):
    """Where session records live. Calls are synchronous and short (the event loop makes them)."""

    def get(self, key: str, *, breaks: bool = True) -> Session | None:
        """The session's record; with its break records unless ``breaks`` is False (admission never
        reads them, and with Redis they are a list of up to ``MAX_BREAKS`` JSON records)."""
        ...

    def save(self, session: Session) -> None: ...

    def delete(self, key: str) -> Session | None: ...

    def add_break(self, key: str, record: dict[str, Any]) -> bool: ...

    def seen_since(self, since: float) -> list[Session]:
        """Sessions last seen at or after ``since`` (the active ones, for a given idle TTL)."""
        ...

    def all(self) -> list[Session]: ...


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

    def set_idle_ttl(self, seconds: float) -> None:
        """The idle TTL in force from now (admission learns it from the traffic's think gaps)."""
        self.idle_ttl = seconds

    def get(self, key: str, *, breaks: bool = True) -> Session | None:
        return self.store.get(key, breaks=breaks)

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
