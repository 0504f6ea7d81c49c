"""The load on each rank, summed over replicas: the prefill queued there and the requests in flight.

Routing weighs each rank's queued prefill (the uncached tokens of the requests it sent there that
have no first token yet: ``proxy/stages/route.py``) and bounds each rank's requests in flight
(CHWBL, ``routing/policies/bounds.py``). Each replica only knows the requests it sent itself:
behind a balancer dealing requests to N replicas, each saw about 1/N of every rank's load, spread
a wave of first turns as if the ranks were idle, and judged the load bound on counts so small that
one request more put a rank over it.

So every replica publishes its own load per rank and reads the others' (``exchange``), 100 times a
second while any replica has load on a rank and 20 while none has (``share_interval``), in one
pipelined round trip off the event loop: what a request reads is then its own replica's live counts
plus the others' as of their last exchange. A replica that has not exchanged for ``STALE_S``
(stopped, or cut off from Redis) counts for nothing; its entry is dropped later. With Redis down,
each replica routes on its own counts again.

``memory`` has no other replicas (``LocalShare``); ``redis`` keeps one hash, a field per replica
(``proxy/state/redis/load_share.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

#: Seconds between a replica's exchanges while any replica has load on a rank (``BUSY_INTERVAL_S``)
#: or none does (``SHARE_INTERVAL_S``): how stale the other replicas' counts may be. A prefill
#: another replica sent leaves its queue at the first token; read 50 ms late, it still weighed on
#: the next new session's rank, which another replica then placed away from the blocks its agent's
#: head was on (a replay sending one request at a time, ``tests/helpers/lockstep.py``: 10 of 40 first turns
#: placed as one process placed them, 21-22 at 10 ms). Not a decision's clock: a request's prefill
#: stays queued for at least a round trip to its rank.
BUSY_INTERVAL_S = 0.01
SHARE_INTERVAL_S = 0.05
#: Seconds after its last exchange from which a replica's counts count for nothing.
STALE_S = 1.0


@dataclass(frozen=True, slots=True)
class Load:
    """What is outstanding on each rank (rank name -> count; a rank with none may be absent)."""

    #: Prefill tokens sent and not prefilled yet (no first token).
    prefill: Mapping[str, int] = field(default_factory=dict)
    #: Requests sent and not answered yet.
    requests: Mapping[str, int] = field(default_factory=dict)


def share_interval(own: Load, others: Load) -> float:
    """Seconds until the next exchange: sooner while any replica has load on a rank."""
    busy = any(own.prefill.values()) or any(others.prefill.values())
    busy = busy or any(own.requests.values()) or any(others.requests.values())
    return BUSY_INTERVAL_S if busy else SHARE_INTERVAL_S


class LoadShare(Protocol):
    """Where replicas tell each other the load they put on each rank."""

    def exchange(self, own: Load) -> Load:
        """Publish this replica's load (``own``); return the other live replicas', summed per rank.
        Blocking: called off the event loop."""
        ...

    def leave(self) -> None:
        """This replica stops: its load stops counting at once."""
        ...


class LocalShare:
    """One process: no other replica puts load anywhere."""

    def exchange(self, own: Load) -> Load:
        return Load()

    def leave(self) -> None:
        pass
