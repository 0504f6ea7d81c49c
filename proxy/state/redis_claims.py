"""Admission's claims in Redis (``claims.RoomClaims``): every replica takes room from one ledger.

Keys under ``{prefix}:admission:`` (a hash tag on a Redis Cluster, so each script touches one
slot: ``routing/redis_topology.py``): ``T`` (hash: rank -> tokens claimed and reserved), ``C``
(hash: session -> its claim: rank, body tokens, head, head tokens), ``H`` (hash: rank + head ->
sessions holding it there: a shared head counts once per rank), ``R`` (hash: session -> its
reservation: rank and tokens pairs), ``E`` (sorted set: reservations by expiry), ``S`` (sorted
set: claims by last touch), ``N`` (hash: rank -> sessions claimed or reserved there: what
``max_sessions_per_rank`` caps, checked in the same script as the tokens). A new session's
reservation within the budgets also waits its turn in the shared wait order (``redis_queue.py``'s
keys, in the same slot), read in the same script: no round trip of its own; and when it is granted
nothing, ``reserve_or_enter`` takes its place there in that same script. The scripts that free room
say so on the order's room channel (``redis_queue.room_channel``).

Each call is one script, O(ranks allowed) plus a bounded purge: expired reservations and claims
idle past the idle TTL (sessions that ended on a replica that died before releasing them) go in
batches of ``PURGE_BATCH`` at each reservation. ``reserve`` runs on the request's path (the decision
needs its answer); ``claim`` and ``release`` go through the link's thread, in order.

Redis down: ``reserve`` grants what the replica's own count allowed (logged once, the
``prefixgate_admission_shared_up`` gauge at 0), and when Redis answers again each replica pushes the
claims it made back (``resync``); claims Redis kept of sessions that ended meanwhile idle out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from proxy.state.claims import Ask, Reserved
from proxy.state.redis_queue import LAPSE, admission_keys, entered, entry_args, queue_keys, room_channel
from proxy.state.wait_order import Entry
from routing.redis_link import ERRORS, RedisLink
from routing.redis_topology import ScriptBatch, reply_text

log = logging.getLogger("prefixgate.admission")

PURGE_BATCH = 64
#: Claims pushed back per round trip when Redis returns.
RESYNC_BATCH = 500

_COMMON = """
local T, C, H, R, E, S, N = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
-- tokens freed per rank by this script's drops (what a waiter elsewhere may now take)
local freed = {}
local function free(rank, tokens)
  freed[rank] = (freed[rank] or 0) + tokens
  redis.call('HINCRBY', T, rank, -tokens)
end
local function leave(rank)
  if redis.call('HINCRBY', N, rank, -1) <= 0 then redis.call('HDEL', N, rank) end
end
local function split(s)
  local out = {}
  for part in string.gmatch(s, '[^\\t]+') do out[#out + 1] = part end
  return out
end
local function drop_reservation(key)
  local r = redis.call('HGET', R, key)
  if not r then return end
  local p = split(r)
  for i = 1, #p, 2 do
    free(p[i], tonumber(p[i + 1]))
    leave(p[i])
  end
  redis.call('HDEL', R, key)
  redis.call('ZREM', E, key)
end
local function drop_claim(key)
  local c = redis.call('HGET', C, key)
  if not c then return end
  local p = split(c)
  local tokens = tonumber(p[2])
  if p[3] ~= '-' then
    local held = p[1] .. '\\t' .. p[3]
    if redis.call('HINCRBY', H, held, -1) <= 0 then
      redis.call('HDEL', H, held)
      tokens = tokens + tonumber(p[4])
    end
  end
  free(p[1], tokens)
  leave(p[1])
  redis.call('HDEL', C, key)
  redis.call('ZREM', S, key)
end
local function say_freed(channel)
  for _, tokens in pairs(freed) do
    if tokens > 0 then
      redis.call('PUBLISH', channel, 'room')
      return
    end
  end
end
"""

#: ARGV: now, reservation TTL s, idle TTL s, key, body, head ('-': none), head tokens,
#: sessions per rank (-1: no cap), the wait order's say (``0``: none;
#: ``-``: not waiting, granted while nobody waits; else the place, granted at the head), the place
#: to enter when none is granted (``enter_place``'s lease s, id, client, priority, weight; a lease
#: of ``-``: none, and the four after it unused), then rank, budget (-1: none) pairs. KEYS 8 to 11:
#: the wait order's Q, P, L, F. Returns the member of the place entered (``''``: none), then the
#: ranks granted.
RESERVE = (
    _COMMON
    + LAPSE
    + """
local now, key = tonumber(ARGV[1]), ARGV[4]
local body, head, head_tokens = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local cap = tonumber(ARGV[8])
local Q, P, L, F = KEYS[8], KEYS[9], KEYS[10], KEYS[11]
local function none_granted()
  if ARGV[10] == '-' then return {''} end
  local member = enter_place(Q, P, L, F, now, tonumber(ARGV[10]), ARGV[11], ARGV[12], tonumber(ARGV[13]),
    tonumber(ARGV[14]))
  return {member}
end
for _, k in ipairs(redis.call('ZRANGEBYSCORE', E, '-inf', now, 'LIMIT', 0, %(batch)d)) do
  drop_reservation(k)
end
for _, k in ipairs(redis.call('ZRANGEBYSCORE', S, '-inf', now - tonumber(ARGV[3]), 'LIMIT', 0, %(batch)d)) do
  drop_claim(k)
end
drop_reservation(key)
drop_claim(key)
if ARGV[9] ~= '0' and not first_place(Q, P, L, now, ARGV[9]) then
  return none_granted()
end
local granted, parts = {''}, {}
for i = 15, #ARGV, 2 do
  local rank, budget = ARGV[i], tonumber(ARGV[i + 1])
  local total = tonumber(redis.call('HGET', T, rank) or '0')
  local need = body
  if head == '-' or redis.call('HEXISTS', H, rank .. '\\t' .. head) == 0 then need = need + head_tokens end
  local full = cap >= 0 and tonumber(redis.call('HGET', N, rank) or '0') >= cap
  if not full and (budget < 0 or total <= 0 or total + need <= budget) then
    granted[#granted + 1] = rank
    parts[#parts + 1] = rank
    parts[#parts + 1] = tostring(need)
    redis.call('HINCRBY', T, rank, need)
    redis.call('HINCRBY', N, rank, 1)
  end
end
if #parts == 0 then return none_granted() end
redis.call('HSET', R, key, table.concat(parts, '\\t'))
redis.call('ZADD', E, now + tonumber(ARGV[2]), key)
return granted
""".replace("%(batch)d", str(PURGE_BATCH))
)

#: ARGV: now, key, rank, body, head ('-': none), head tokens, the room channel. Every claim is said
#: there: an answer wakes every replica's waiters as it wakes its own replica's (a claim may free
#: room, and the count they re-check then sees the sessions that time ended meanwhile).
CLAIM = (
    _COMMON
    + """
local key, rank, body, head = ARGV[2], ARGV[3], tonumber(ARGV[4]), ARGV[5]
drop_reservation(key)
drop_claim(key)
local add = body
if head ~= '-' and redis.call('HINCRBY', H, rank .. '\\t' .. head, 1) == 1 then
  add = add + tonumber(ARGV[6])
end
redis.call('HINCRBY', T, rank, add)
redis.call('HINCRBY', N, rank, 1)
redis.call('HSET', C, key, rank .. '\\t' .. ARGV[4] .. '\\t' .. head .. '\\t' .. ARGV[6])
redis.call('ZADD', S, tonumber(ARGV[1]), key)
redis.call('PUBLISH', ARGV[7], 'claim')
return add
"""
)

#: ARGV: key, the room channel (told when it freed room).
RELEASE = (
    _COMMON
    + """
drop_reservation(ARGV[1])
drop_claim(ARGV[1])
say_freed(ARGV[2])
return 1
"""
)

Claim = tuple[str, int, str, int]
#: ``RESERVE``'s entry arguments when it enters no place.
NO_ENTRY: list[str | int] = ["-", "", "", 0, 1]


class RedisClaims:
    """``RoomClaims`` over Redis, shared by every replica (see the module docstring)."""

    def __init__(
        self,
        link: RedisLink,
        prefix: str = "prefixgate",
        on_state: Callable[[bool], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.link = link
        self.clock = clock
        self.keys = admission_keys(link.client, prefix, ("T", "C", "H", "R", "E", "S", "N"))
        self._reserve_keys = self.keys + queue_keys(link.client, prefix)
        self.channel = room_channel(link.client, prefix)
        client = link.client
        self._reserve = client.register_script(RESERVE)
        self._claim = client.register_script(CLAIM)
        self._release = client.register_script(RELEASE)
        #: The claims this replica made last, per session: what it pushes back when Redis returns.
        self._mine: dict[str, Claim] = {}
        self._shared = True
        self._on_state = on_state
        link.on_resync(self.resync)
        link.on_state(self._link_state)

    def _link_state(self, up: bool) -> None:
        # any store on this Redis failing opens the shared circuit: say so before the next admission
        if not up:
            self._local("the link to it failed")

    def _local(self, why: object) -> None:
        if self._shared:
            self._shared = False
            log.warning(
                "admission: Redis unreachable (%s); this replica admits on its own count until it returns",
                why,
            )
            if self._on_state is not None:
                self._on_state(False)

    def reserve(self, ask: Ask) -> frozenset[str]:
        return self.reserve_or_enter(ask, None).granted

    def reserve_or_enter(self, ask: Ask, entry: Entry | None) -> Reserved:
        if not ask.budgets:
            return Reserved(frozenset())
        if not self.link.available():
            self._local("its circuit is open")
            return Reserved(frozenset(ask.budgets))
        place, entering = entry_args(entry) if entry is not None else ("", NO_ENTRY)
        args: list[str | int | float] = [
            repr(self.clock()),
            repr(ask.expires_in),
            repr(ask.idle_ttl),
            ask.key,
            max(ask.body, 0),
            ask.head or "-",
            ask.head_tokens if ask.head else 0,
            -1 if ask.max_sessions is None else ask.max_sessions,
            (ask.place or "-") if ask.queued else "0",
            *entering,
        ]
        for rank, budget in ask.budgets.items():
            args += [rank, -1 if budget is None else budget]
        try:
            member, *granted = self._reserve(keys=self._reserve_keys, args=args)
        except ERRORS as exc:
            self.link.failed(exc)
            self._local(exc)
            return Reserved(frozenset(ask.budgets))
        ranks = frozenset(reply_text(r) for r in granted)
        return Reserved(ranks, entered(place, member) if member else None)

    def claim(self, key: str, rank: str, body: int, head: str | None, head_tokens: int) -> None:
        claim = (rank, max(body, 0), head or "-", head_tokens if head else 0)
        self._mine[key] = claim
        args: list[str | int] = [repr(self.clock()), key, *claim, self.channel]
        self.link.submit(lambda: self._claim(keys=self.keys, args=args))

    def release(self, key: str) -> None:
        self._mine.pop(key, None)
        self.link.submit(lambda: self._release(keys=self.keys, args=[key, self.channel]))

    def totals(self) -> dict[str, int]:
        return self._per_rank(self.keys[0])

    def sessions(self) -> dict[str, int]:
        return self._per_rank(self.keys[6])

    def _per_rank(self, hash_key: str) -> dict[str, int]:
        raw = self.link.call(lambda: self.link.client.hgetall(hash_key))
        return {reply_text(k): int(v) for k, v in (raw or {}).items()}

    def resync(self) -> None:
        """Push this replica's claims back (the link's thread, before the circuit closes)."""
        mine = list(self._mine.items())  # a copy: the event loop may claim meanwhile
        now = repr(self.clock())
        for start in range(0, len(mine), RESYNC_BATCH):
            batch = ScriptBatch(self.link.client)
            for key, claim in mine[start : start + RESYNC_BATCH]:
                args: list[str | int] = [now, key, *claim, self.channel]
                self._claim(keys=self.keys, args=args, client=batch.target)
            batch.execute()
        if not self._shared:
            self._shared = True
            log.info(
                "admission: Redis back; %d claims of this replica pushed back, room shared again", len(mine)
            )
            if self._on_state is not None:
                self._on_state(True)
