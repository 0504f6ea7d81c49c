"""The state backend: where the state that decides placement lives, chosen once per process.

A backend serves the session table's store, the prefix index, the response id -> rank map and
admission's claims on room (``StateBackend``). ``memory`` keeps them in this process; ``redis``
shares them between replicas. The load each replica puts on each rank is not shared: each routes on
its own counts (``docs/investigations.md``: two replicas finished sooner without sharing them).
A new backend is one new module plus one line in ``BACKENDS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from proxy.config import ConfigError, Settings
from proxy.state.claims import RoomClaims
from proxy.state.memory import MemoryState
from proxy.state.redis.backend import RedisState
from proxy.state.responses import ResponseRanks
from proxy.state.sessions import SessionStore
from routing.index import PrefixIndex


class StateBackend(Protocol):
    """What a state backend provides (each call builds a new store over the backend)."""

    name: str

    def sessions(self) -> SessionStore: ...

    def response_ranks(self) -> ResponseRanks: ...

    def claims(self, on_state: Callable[[bool], None]) -> RoomClaims:
        """Where admission takes room (``on_state(shared)``: told when a shared ledger becomes
        unreachable, so that each replica admits on its own count, and back)."""
        ...

    def prefix_index(
        self, model: str, block_size: int, hash_algo: str, on_state: Callable[[bool], None]
    ) -> PrefixIndex:
        """The prefix index for ranks serving ``model`` with ``block_size`` blocks hashed with
        ``hash_algo``; ``on_state(up)`` is told when a shared index becomes unreachable and back."""
        ...

    def agree_index_namespace(self, proposal: str | None) -> str | None:
        """The prefix index's namespace every replica uses: the one agreed first (``proposal`` when no
        replica proposed one before; a shared store keeps the first, whoever starts when), None when
        none is agreed yet and ``proposal`` is None. Blocking (a round trip to a shared store)."""
        ...

    def move_index(self, namespace: str) -> None:
        """The replicas agreed on ``namespace`` after this one opened its index under another (no
        rank was up to name the model): a shared index moves there; one process's has none to keep."""
        ...

    def backlog(self) -> tuple[int, float] | None:
        """Writes queued for a shared store now and how long the latest one run had waited (how
        late other replicas see this one's writes); None without a shared store."""
        ...

    def dropped_saves(self) -> int | None:
        """This process's session saves the shared store dropped for a later version of the record
        (saved meanwhile by another replica: that turn's usage counters are lost); None without one."""
        ...

    def close(self) -> None: ...


def _memory(settings: Settings) -> StateBackend:
    return MemoryState()


def _redis(settings: Settings) -> StateBackend:
    if not settings.redis_url:
        raise ConfigError("state 'redis' needs --redis-url (redis://[:password@]host:port/db)")
    return RedisState(settings.redis_url, settings.redis_timeout, settings.index_ttl)


#: Backend name -> its constructor from the settings.
BACKENDS: dict[str, Callable[[Settings], StateBackend]] = {
    "memory": _memory,
    "redis": _redis,
}


def backend_name(settings: Settings) -> str:
    """``settings.state``, else ``redis`` with a Redis URL and ``memory`` without."""
    return settings.state or ("redis" if settings.redis_url else "memory")


def open_state(settings: Settings) -> StateBackend:
    """The state backend the settings choose (``ConfigError`` for an unknown one)."""
    name = backend_name(settings)
    build = BACKENDS.get(name)
    if build is None:
        raise ConfigError(f"unknown state backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return build(settings)


__all__ = ["BACKENDS", "StateBackend", "backend_name", "open_state"]
