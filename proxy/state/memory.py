"""The memory state backend: everything placement depends on, in this process only.

``MemorySessionStore`` keeps session records in a dict ordered by last save; the prefix index is
``routing.index.memory.MemoryPrefixIndex``; response ids map to ranks in a bounded LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from proxy.state.claims import LocalClaims, RoomClaims
from proxy.state.responses import MemoryResponseRanks, ResponseRanks
from proxy.state.sessions import DEFAULT_MAX_SESSIONS, MAX_BREAKS, MAX_SAVE_LAG_S, Session, SessionStore
from routing.index import PrefixIndex
from routing.index.memory import MemoryPrefixIndex


class MemorySessionStore:
    """Records in a dict ordered by last save (the most recent last), bounded by ``max_sessions``."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS) -> None:
        self.max_sessions = max_sessions
        self._by_key: OrderedDict[str, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: str, *, breaks: bool = True) -> Session | None:
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


class MemoryState:
    """The ``memory`` backend (the default without ``--redis-url``): one process's own state."""

    name = "memory"

    def sessions(self) -> SessionStore:
        return MemorySessionStore()

    def response_ranks(self) -> ResponseRanks:
        return MemoryResponseRanks()

    def claims(self, on_state: Callable[[bool], None]) -> RoomClaims:
        return LocalClaims()

    def prefix_index(
        self, model: str, block_size: int, hash_algo: str, on_state: Callable[[bool], None]
    ) -> PrefixIndex:
        return MemoryPrefixIndex()

    def agree_index_namespace(self, proposal: str | None) -> str | None:
        return proposal  # one process: nothing to agree with

    def move_index(self, namespace: str) -> None:
        pass

    def backlog(self) -> tuple[int, float] | None:
        return None

    def dropped_saves(self) -> int | None:
        return None

    def close(self) -> None:
        pass
