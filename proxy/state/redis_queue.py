"""Admission's wait order in Redis (``wait_order.WaitOrder``): every replica's waiters in one order.

Keys beside the claims' (``redis_claims.py``: the same ``{prefix}:admission:`` hash tag, so the
reservation script reads the order in its own slot): ``Q`` (sorted set, every score 0, ordered by
member: ``priority, fair-share tag, arrival, id`` as fixed-width text, so the lexicographic order is
the queue's), ``P`` (hash: place id -> its member), ``L`` (sorted set: place ids by lease expiry),
``F`` (hash: client key -> the fair-share tag its next waiter starts from; ``\\tV``: the virtual
time, the tag of the waiter served last; ``\\tN``: the arrival counter). The fair-share rule is
``queue.WaitQueue``'s, kept in Redis so that tags compare across replicas.

Only waiting requests touch the order: a place once (entered by the reservation script that found
no room, ``redis_claims.RESERVE``, in the same step: nobody arriving later takes the room between
the two; or by ``enter`` when this replica's own count found none), ``leave`` once, and each replica
renews all its waiters' leases in one round trip per ``lease_s / 3`` while it has any; a request
admitted at once pays nothing here (the reservation script it runs anyway checks that nobody
waits). Places whose lease lapsed (their replica died, or stalled past the lease) go in batches of
``LAPSE_BATCH`` at each script that reads the order; a live waiter's next renewal restores its
place, and moves the order's clocks (``\\tV``, ``\\tN``) to at least its tag and arrival: in a
Redis that restarted empty, the waiters restored keep their turn ahead of those arriving after.
(Those arriving between the restart and the renewal, at most ``lease_s / 3`` later, may stand
before them.)

What wakes one replica's waiters wakes every replica's: each claim (an answer, a placement), each
release that freed room and the first place leaving are said on a pub/sub channel
(``room_channel``, published by the scripts themselves: no round trip of its own); each replica's
listener (``watch``: one connection, one thread) wakes its waiters, whose own poll is then only the
safety net. A cluster's pub/sub reaches every node, and the channel is in the claims' slot anyway.

Redis down: ``enter`` answers None (logged once, ``on_state(False)``; so does the link failing
anywhere), so the waiter queues in its replica's own order, as the claims fall back to the
replica's own count; the link coming back, or the next ``enter`` that reaches Redis, says it is
back.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from proxy.state.wait_order import Entry, Place
from routing.redis_link import ERRORS, RedisLink
from routing.redis_topology import reply_text, slot_prefix

log = logging.getLogger("prefixgate.admission")

LAPSE_BATCH = 64
#: Priorities are stored as ``PRIORITY_ZERO - priority`` in six digits (higher first).
PRIORITY_ZERO = 500_000
QUEUE_KEYS = ("Q", "P", "L", "F")
#: Seconds the room channel's listener blocks per read (then checks whether its link closed).
LISTEN_S = 1.0

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
local function enter_place(Q, P, L, F, now, lease, id, client, priority, weight)
  lapse(Q, P, L, now)
  local v = tonumber(redis.call('HGET', F, '\\tV') or '0')
  local start = math.max(v, tonumber(redis.call('HGET', F, client) or '0'))
  redis.call('HSET', F, client, string.format('%.17g', start + 1 / weight))
  local seq = redis.call('HINCRBY', F, '\\tN', 1)
  local member = string.format('%06d\\t%024.9f\\t%015d\\t', %(zero)d - priority, start, seq) .. id
  redis.call('ZADD', Q, 0, member)
  redis.call('HSET', P, id, member)
  redis.call('ZADD', L, now + lease, id)
  return member
end
""".replace("%(batch)d", str(LAPSE_BATCH)).replace("%(zero)d", str(PRIORITY_ZERO))

#: KEYS: Q, P, L, F. ARGV: now, lease s, id, client, priority, weight. Returns the place's member.
ENTER = (
    LAPSE
    + """
local now = tonumber(ARGV[1])
return enter_place(KEYS[1], KEYS[2], KEYS[3], KEYS[4], now, tonumber(ARGV[2]), ARGV[3], ARGV[4],
  tonumber(ARGV[5]), tonumber(ARGV[6]))
"""
)

#: KEYS: Q, P, L, F. ARGV: now, lease s, then id, member pairs. A place restored (lapsed, or lost
#: with a restarted Redis) moves the order's clocks (``F``'s virtual time and arrival counter) to at
#: least its own tag and arrival: later arrivals then stand behind it, as they did before.
RENEW = """
local expiry = tonumber(ARGV[1]) + tonumber(ARGV[2])
local F = KEYS[4]
for i = 3, #ARGV, 2 do
  local member = ARGV[i + 1]
  if redis.call('HSETNX', KEYS[2], ARGV[i], member) == 1 then
    redis.call('ZADD', KEYS[1], 0, member)
    local tag, seq = string.match(member, '^%d+\\t([^\\t]+)\\t(%d+)\\t')
    tag, seq = tonumber(tag), tonumber(seq)
    if tag > tonumber(redis.call('HGET', F, '\\tV') or '0') then
      redis.call('HSET', F, '\\tV', string.format('%.17g', tag))
    end
    if seq > tonumber(redis.call('HGET', F, '\\tN') or '0') then
      redis.call('HSET', F, '\\tN', string.format('%d', seq))
    end
  end
  redis.call('ZADD', KEYS[3], expiry, ARGV[i])
end
return 1
"""

#: KEYS: Q, P, L, F. ARGV: id, member, served (0/1), the room channel. The first place leaving lets
#: the next one take room: said on the channel.
LEAVE = """
if redis.call('ZRANGE', KEYS[1], 0, 0)[1] == ARGV[2] then redis.call('PUBLISH', ARGV[4], 'order') end
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


def room_channel(client: Any, prefix: str = "prefixgate") -> str:
    """The channel on which what may free room (a claim, a release, the first waiter leaving) is
    said, in the claims' slot (a cluster's pub/sub reaches every node)."""
    return admission_keys(client, prefix, ("room",))[0]


def place_order(member: str) -> tuple[int, float, int]:
    """Where the place of ``member`` stands: ``(-priority, fair-share tag, arrival)``."""
    priority, tag, seq, _ = member.split("\t", 3)
    return int(priority) - PRIORITY_ZERO, float(tag), int(seq)


def entry_args(entry: Entry) -> tuple[str, list[str | int]]:
    """A new place's id for ``entry``, and the script arguments entering it (``enter_place``'s:
    lease s, id, client, priority, weight)."""
    place = uuid.uuid4().hex
    bounded = max(-PRIORITY_ZERO + 1, min(PRIORITY_ZERO - 1, entry.priority))
    return place, [repr(entry.lease_s), place, entry.client or "", bounded, repr(entry.weight)]


def entered(place: str, raw: bytes | str) -> Place:
    """The place ``place`` whose member a script returned."""
    member = reply_text(raw)
    return Place(place, place_order(member), member)


class RedisWaitOrder:
    """``WaitOrder`` over Redis, shared by every replica (see the module docstring)."""

    #: Leases are compared across replicas: wall-clock time, as the claims' expiries are.
    clock = staticmethod(time.time)
    shared_places = True

    def __init__(
        self, link: RedisLink, on_state: Callable[[bool], None] | None = None, *, prefix: str = "prefixgate"
    ) -> None:
        """``link`` and ``prefix``: the ones the claims use (their keys' slot: the reservation script
        reads the order); ``on_state(shared)``: told when the order becomes unreachable, and back."""
        self.link = link
        self.keys = queue_keys(link.client, prefix)
        self.channel = room_channel(link.client, prefix)
        self._enter, self._renew, self._leave = (
            link.client.register_script(s) for s in (ENTER, RENEW, LEAVE)
        )
        self._shared, self._on_state = True, on_state
        self._wakes: list[Callable[[], None]] = []
        self._listener: threading.Thread | None = None
        # places also come from the claims' reservation script: the link's state is the order's too
        link.on_state(lambda up: self._state(up, "the link to it failed"))

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
        place, entry = entry_args(Entry(client, priority, weight, lease_s))
        try:
            raw = self._enter(keys=self.keys, args=[repr(self.clock()), *entry])
        except ERRORS as exc:
            self.link.failed(exc)
            self._state(False, exc)
            return None
        self._state(True)
        return entered(place, raw)

    def renew(self, places: Sequence[Place], lease_s: float) -> None:
        if not places:
            return
        args = [repr(self.clock()), repr(lease_s)]
        for place in places:
            args += [place.id, place.member]
        self.link.call(lambda: self._renew(keys=self.keys, args=args))

    def leave(self, place: Place, served: bool) -> None:
        args: list[str | int] = [place.id, place.member, 1 if served else 0, self.channel]
        self.link.call(lambda: self._leave(keys=self.keys, args=args))

    def watch(self, wake: Callable[[], None]) -> None:
        self._wakes.append(wake)
        if self._listener is None:
            self._listener = threading.Thread(target=self._listen, name="redis-room", daemon=True)
            self._listener.start()

    def _wake(self) -> None:
        for wake in self._wakes:
            wake()

    def _listen(self) -> None:
        """The listener's thread: each message on the room channel wakes the waiters; so does each
        (re)subscription, for what was said while it was not subscribed."""
        while not self.link.closed:
            pubsub = None
            try:
                pubsub = self.link.client.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(self.channel)
                self._wake()
                while not self.link.closed:
                    if pubsub.get_message(timeout=LISTEN_S) is not None:
                        self._wake()
            except Exception as exc:  # Redis down, failing over, or its link closing under the read
                # the waiters' own poll goes on meanwhile; this thread must not end
                if self.link.closed:
                    return
                log.debug("admission queue: room channel lost (%s); subscribing again", exc)
                time.sleep(self.link.retry_interval)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()
