"""Admission's wait order in Redis (``wait_order.WaitOrder``): every replica's waiters in one order.

Keys beside the claims' (``redis_claims.py``: the same ``{prefix}:admission:`` hash tag, so the
reservation script reads the order in its own slot): ``Q`` (sorted set, every score 0, ordered by
member: ``priority, fair-share tag, arrival, id`` as fixed-width text, so the lexicographic order is
the queue's), ``P`` (hash: place id -> its member), ``L`` (sorted set: place ids by lease expiry),
``F`` (hash: client key -> the fair-share tag its next waiter starts from; ``\\tV``: the virtual
time, the tag of the waiter served last; ``\\tN``: the arrival counter). The fair-share rule is
``queue.WaitQueue``'s, kept in Redis so that tags compare across replicas.

Only waiting requests touch the order: ``enter`` and ``leave`` once each, and each replica renews
all its waiters' leases in one round trip per ``lease_s / 3`` while it has any; a request admitted
at once pays nothing here (the reservation script it
runs anyway checks that nobody waits). Places whose lease lapsed (their replica died, or stalled
past the lease) go in batches of ``LAPSE_BATCH`` at each script that reads the order; a live waiter's
next renewal restores its place.

Redis down: ``enter`` answers None (logged once, ``on_state(False)``), so the waiter queues in its
replica's own order, as the claims fall back to the replica's own count; the next ``enter`` that
reaches Redis says it is back.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from proxy.state.wait_order import Place
from routing.redis_link import ERRORS, RedisLink
from routing.redis_topology import slot_prefix

log = logging.getLogger("prefixgate.admission")

LAPSE_BATCH = 64
#: Priorities are stored as ``PRIORITY_ZERO - priority`` in six digits (higher first).
PRIORITY_ZERO = 500_000
QUEUE_KEYS = ("Q", "P", "L", "F")

#: ``lapse(Q, P, L, now)``: drop the places whose lease ran out (a bounded batch); ``first_place(Q,
#: P, L, now, place)``: whether ``place`` (``-``: none) may take room, nobody standing before it.
LAPSE = """
local function lapse(Q, P, L, now)
  for _, id in ipairs(redis.call('ZRANGEBYSCORE', L, '-inf', now, 'LIMIT', 0, %(batch)d)) do
    local m = redis.call('HGET', P, id)
    if m then redis.call('ZREM', Q, m) end
    redis.call('HDEL', P, id)
    redis.call('ZREM', L, id)
  end
end
local function first_place(Q, P, L, now, place)
  lapse(Q, P, L, now)
  local first = redis.call('ZRANGE', Q, 0, 0)[1]
  return (not first) or (place ~= '-' and redis.call('HGET', P, place) == first)
end
""".replace("%(batch)d", str(LAPSE_BATCH))

#: KEYS: Q, P, L, F. ARGV: now, lease s, id, client, priority, weight. Returns the place's member.
ENTER = (
    LAPSE
    + """
local Q, P, L, F = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now, id, client = tonumber(ARGV[1]), ARGV[3], ARGV[4]
lapse(Q, P, L, now)
local v = tonumber(redis.call('HGET', F, '\\tV') or '0')
local start = math.max(v, tonumber(redis.call('HGET', F, client) or '0'))
redis.call('HSET', F, client, string.format('%.17g', start + 1 / tonumber(ARGV[6])))
local seq = redis.call('HINCRBY', F, '\\tN', 1)
local member = string.format('%06d\\t%024.9f\\t%015d\\t', %(zero)d - tonumber(ARGV[5]), start, seq) .. id
redis.call('ZADD', Q, 0, member)
redis.call('HSET', P, id, member)
redis.call('ZADD', L, now + tonumber(ARGV[2]), id)
return member
""".replace("%(zero)d", str(PRIORITY_ZERO))
)

#: KEYS: Q, P, L. ARGV: now, lease s, then id, member pairs.
RENEW = """
local expiry = tonumber(ARGV[1]) + tonumber(ARGV[2])
for i = 3, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1]) == 1 then
    redis.call('ZADD', KEYS[1], 0, ARGV[i + 1])
  end
  redis.call('ZADD', KEYS[3], expiry, ARGV[i])
end
return 1
"""

#: KEYS: Q, P, L, F. ARGV: id, member, served (0/1).
LEAVE = """
redis.call('ZREM', KEYS[1], ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('ZREM', KEYS[3], ARGV[1])
if ARGV[3] == '1' then
  local tag = tonumber(string.match(ARGV[2], '^%d+\\t([^\\t]+)\\t'))
  if tag > tonumber(redis.call('HGET', KEYS[4], '\\tV') or '0') then
    redis.call('HSET', KEYS[4], '\\tV', string.format('%.17g', tag))
  end
end
return 1
"""


def admission_keys(client: Any, prefix: str, names: Sequence[str]) -> list[str]:
    """The keys ``names`` under ``{prefix}:admission:`` on ``client``'s Redis, all in one slot: the
    claims' and the order's, which the reservation script reads together."""
    base = slot_prefix(f"{prefix}:admission", client) + ":"
    return [base + name for name in names]


def queue_keys(client: Any, prefix: str = "prefixgate") -> list[str]:
    """The order's keys (``QUEUE_KEYS``) on ``client``'s Redis, in the slot of the claims' under
    ``prefix``."""
    return admission_keys(client, prefix, QUEUE_KEYS)


def place_order(member: str) -> tuple[int, float, int]:
    """Where the place of ``member`` stands: ``(-priority, fair-share tag, arrival)``."""
    priority, tag, seq, _ = member.split("\t", 3)
    return int(priority) - PRIORITY_ZERO, float(tag), int(seq)


class RedisWaitOrder:
    """``WaitOrder`` over Redis, shared by every replica (see the module docstring)."""

    #: Leases are compared across replicas: wall-clock time, as the claims' expiries are.
    clock = staticmethod(time.time)

    def __init__(
        self, link: RedisLink, on_state: Callable[[bool], None] | None = None, *, prefix: str = "prefixgate"
    ) -> None:
        """``link`` and ``prefix``: the ones the claims use (their keys' slot: the reservation script
        reads the order); ``on_state(shared)``: told when the order becomes unreachable, and back."""
        self.link = link
        self.keys = queue_keys(link.client, prefix)
        self._enter, self._renew, self._leave = (
            link.client.register_script(s) for s in (ENTER, RENEW, LEAVE)
        )
        self._shared, self._on_state = True, on_state

    def _state(self, shared: bool, why: object = None) -> None:
        if shared == self._shared:
            return
        self._shared = shared
        if shared:
            log.info("admission queue: Redis back; waiters take their turn in the shared order again")
        else:
            log.warning(
                "admission queue: Redis unreachable (%s); this replica's waiters queue in its own order",
                why,
            )
        if self._on_state is not None:
            self._on_state(shared)

    def enter(self, client: str | None, priority: int, weight: float, lease_s: float) -> Place | None:
        if not self.link.available():
            self._state(False, "its circuit is open")
            return None
        place = uuid.uuid4().hex
        bounded = max(-PRIORITY_ZERO + 1, min(PRIORITY_ZERO - 1, priority))
        args: list[str | int] = [
            repr(self.clock()),
            repr(lease_s),
            place,
            client or "",
            bounded,
            repr(weight),
        ]
        try:
            raw = self._enter(keys=self.keys, args=args)
        except ERRORS as exc:
            self.link.failed(exc)
            self._state(False, exc)
            return None
        self._state(True)
        member = raw.decode() if isinstance(raw, bytes) else str(raw)
        return Place(place, place_order(member), member)

    def renew(self, places: Sequence[Place], lease_s: float) -> None:
        if not places:
            return
        args = [repr(self.clock()), repr(lease_s)]
        for place in places:
            args += [place.id, place.member]
        self.link.call(lambda: self._renew(keys=self.keys[:3], args=args))

    def leave(self, place: Place, served: bool) -> None:
        args: list[str | int] = [place.id, place.member, 1 if served else 0]
        self.link.call(lambda: self._leave(keys=self.keys, args=args))
