"""The prefill queued on each rank, summed over replicas.

Routing weighs each rank's queued prefill (the uncached tokens of the requests it sent there that
have no first token yet: ``proxy/stages/route.py``), and admission calls a rank whose queue takes
many wait bounds saturated (``proxy/admission/cost.py``). Each replica only knows the requests it
sent itself: behind a balancer dealing requests to N replicas, each saw about 1/N of every queue,
spread a wave of first turns as if the ranks were idle, and never found a rank saturated.

So every replica publishes its own queue per rank and reads the others' (``exchange``), a few
times a second (``SHARE_INTERVAL_S``), in one pipelined round trip off the event loop: what a
request reads is then its own replica's live count plus the others' as of their last exchange.
A replica that has not exchanged for ``STALE_S`` (stopped, or cut off from Redis) counts for
nothing; its entry is dropped later. With Redis down, each replica routes on its own queue again.

``memory`` has no other replicas (``LocalShare``); ``redis`` keeps one hash, a field per replica
(``RedisShare``: one key, so it lives in one Redis Cluster slot).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any, Protocol

import orjson

from routing.redis_link import RedisLink

#: Seconds between a replica's exchanges: how stale the other replicas' queues may be. Not a
#: decision's clock: a request's prefill stays queued for at least a round trip to its rank.
SHARE_INTERVAL_S = 0.05
#: Seconds after its last exchange from which a replica's queues count for nothing (dropped from
#: Redis after ``DROP_AFTER`` times as long).
STALE_S = 1.0
DROP_AFTER = 30


class PrefillShare(Protocol):
    """Where replicas tell each other the prefill they queued on each rank."""

    def exchange(self, own: Mapping[str, int]) -> dict[str, int]:
        """Publish this replica's queued prefill tokens per rank (``own``); return the other live
        replicas', summed per rank. Blocking: called off the event loop."""
        ...

    def leave(self) -> None:
        """This replica stops: its queues stop counting at once."""
        ...


class LocalShare:
    """One process: no other replica queues anything."""

    def exchange(self, own: Mapping[str, int]) -> dict[str, int]:
        return {}

    def leave(self) -> None:
        pass


class RedisShare:
    """``PrefillShare`` in one Redis hash: field = replica id, value = its last exchange's time
    (wall clock, compared across replicas like the claims' expiries) and queues."""

    def __init__(self, link: RedisLink, key: str = "prefixgate:prefill", replica: str | None = None) -> None:
        self.link = link
        self.key = key
        self.replica = replica or uuid.uuid4().hex

    def exchange(self, own: Mapping[str, int]) -> dict[str, int]:
        now = time.time()
        mine = orjson.dumps({"at": now, "queued": {rank: n for rank, n in own.items() if n}})

        def swap() -> Any:
            pipe = self.link.client.pipeline(transaction=False)
            pipe.hset(self.key, self.replica, mine)
            pipe.hgetall(self.key)
            return pipe.execute()[1]

        found = self.link.call(swap)
        if not found:
            return {}
        others: dict[str, int] = {}
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
            for rank, tokens in entry["queued"].items():
                others[rank] = others.get(rank, 0) + tokens
        if gone:
            self.link.call(lambda: self.link.client.hdel(self.key, *gone))
        return others

    def leave(self) -> None:
        self.link.call(lambda: self.link.client.hdel(self.key, self.replica))
