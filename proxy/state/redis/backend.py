"""The ``redis`` state backend: every store that decides placement on one Redis, behind one link.

The session table is ``sessions.py`` (whose docstring tells how the stores fail over to their
mirrors and push them back); the claims, the response map and the prefix index are
their own modules.
"""

from __future__ import annotations

from collections.abc import Callable

from proxy.state.claims import RoomClaims
from proxy.state.redis.claims import RedisClaims
from proxy.state.redis.index import RedisPrefixIndex
from proxy.state.redis.index_namespace import NAMESPACE_KEY, agree
from proxy.state.redis.link import RedisLink, fail_fast_client
from proxy.state.redis.responses import RedisResponseRanks
from proxy.state.redis.sessions import RedisSessionStore
from proxy.state.responses import ResponseRanks
from proxy.state.sessions import SessionStore
from routing.index import PrefixIndex


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
        self._session_stores: list[RedisSessionStore] = []
        self._indexes: list[RedisPrefixIndex] = []

    def sessions(self) -> SessionStore:
        store = RedisSessionStore(self.url, socket_timeout=self.timeout, link=self.link)
        self._session_stores.append(store)
        return store

    def response_ranks(self) -> ResponseRanks:
        return RedisResponseRanks(self.client, link=self.link)

    def claims(self, on_state: Callable[[bool], None]) -> RoomClaims:
        return RedisClaims(self.link, on_state=on_state)

    def prefix_index(
        self, model: str, block_size: int, hash_algo: str, on_state: Callable[[bool], None]
    ) -> PrefixIndex:
        index = RedisPrefixIndex(
            self.url,
            model=model,
            block_size=block_size,
            hash_algo=hash_algo,
            ttl_s=self.index_ttl,
            socket_timeout=self.timeout,
            on_state=on_state,
            link=self.link,
        )
        self._indexes.append(index)
        return index

    def move_index(self, namespace: str) -> None:
        for index in self._indexes:
            index.move_to(namespace)

    def agree_index_namespace(self, proposal: str | None) -> str | None:
        """First writer wins (``SET NX``): replicas started at different moments, each first asking
        whichever rank was up, all use the namespace proposed first. Redis unreachable: ``proposal``
        for now (the caller asks again when it learns more)."""
        return self.link.call(lambda: agree(self.client, NAMESPACE_KEY, proposal)) or proposal

    def backlog(self) -> tuple[int, float] | None:
        return self.link.backlog()

    def dropped_saves(self) -> int | None:
        return sum(store.dropped_saves for store in self._session_stores)

    def close(self) -> None:
        self.link.close()
