"""``load_share.LoadShare`` in Redis: one hash, a field per replica (one key, so it lives in one
Redis Cluster slot). A replica whose last exchange is older than ``STALE_S`` counts for nothing; its
field is dropped after ``DROP_AFTER`` times as long."""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any

import orjson

from proxy.state.load_share import STALE_S, Load
from proxy.state.redis.link import RedisLink

#: A stale replica's field is dropped from Redis after this many times ``STALE_S``.
DROP_AFTER = 30


def _nonzero(counts: Mapping[str, int]) -> dict[str, int]:
    return {rank: n for rank, n in counts.items() if n}


def _add(into: dict[str, int], counts: Mapping[str, int]) -> None:
    for rank, n in counts.items():
        into[rank] = into.get(rank, 0) + n


class RedisShare:
    """``LoadShare`` in one Redis hash: field = replica id, value = its last exchange's time (wall
    clock, compared across replicas like the claims' expiries) and load."""

    def __init__(self, link: RedisLink, key: str = "prefixgate:load", replica: str | None = None) -> None:
        self.link = link
        self.key = key
        self.replica = replica or uuid.uuid4().hex

    def exchange(self, own: Load) -> Load:
        now = time.time()
        mine = orjson.dumps({"at": now, "prefill": _nonzero(own.prefill), "requests": _nonzero(own.requests)})

        def swap() -> Any:
            pipe = self.link.client.pipeline(transaction=False)
            pipe.hset(self.key, self.replica, mine)
            pipe.hgetall(self.key)
            return pipe.execute()[1]

        found = self.link.call(swap)
        if not found:
            return Load()
        prefill: dict[str, int] = {}
        requests: dict[str, int] = {}
        gone = []
        for replica, raw in found.items():
            name = replica.decode() if isinstance(replica, bytes) else replica
            if name == self.replica:
                continue
            entry = orjson.loads(raw)
            age = now - entry["at"]
            if age > STALE_S:
                if age > DROP_AFTER * STALE_S:
                    gone.append(name)
                continue
            _add(prefill, entry["prefill"])
            _add(requests, entry["requests"])
        if gone:
            self.link.call(lambda: self.link.client.hdel(self.key, *gone))
        return Load(prefill, requests)

    def leave(self) -> None:
        self.link.call(lambda: self.link.client.hdel(self.key, self.replica))
