"""Admission's claims in Redis (``claims.RoomClaims``): every replica takes room from one ledger.

Keys under ``{prefix}:admission:`` (a hash tag on a Redis Cluster, so each script touches one
slot: ``proxy/state/redis/topology.py``): ``T`` (hash: rank -> tokens claimed and reserved), ``C``
(hash: session -> its claim: rank, body tokens, head, head tokens), ``H`` (hash: rank + head ->
sessions holding it there: a shared head counts once per rank), ``R`` (hash: session -> its
reservation: rank and tokens pairs), ``E`` (sorted set: reservations by expiry), ``S`` (sorted
set: claims by last touch), ``N`` (hash: rank -> sessions claimed or reserved there: what
``max_sessions_per_rank`` caps, checked in the same script as the tokens).

What wakes one replica's waiters wakes every replica's: each claim (an answer, a placement) and each
release that freed room are said on a pub/sub channel (``room_channel``, published by the scripts
themselves: no round trip of its own); each replica's listener (``watch``: one connection, one
thread) wakes its waiters, whose own poll is then only the safety net. A cluster's pub/sub reaches
every node, and the channel is in the claims' slot anyway. Each replica's waiters stand in its own
queue: a wait order shared by the replicas cost hit rate in a two-replica benchmark
(docs/investigations.md) and was removed.

Each call is one script, O(ranks allowed) plus a bounded purge: expired reservations and claims
idle past the idle TTL (sessions that ended on a replica that died before releasing them) go in
batches of ``PURGE_BATCH`` at each reservation. ``reserve`` runs on the request's path (the decision
needs its answer); ``claim`` and ``release`` go through the link's thread, in order.

Redis down: ``reserve`` grants what the replica's own count allowed (logged once, the
``prefixgate_admission_shared_up`` gauge at 0), and when Redis answers again each replica pushes the
claims it made back (``resync``); claims Redis kept of sessions that ended meanwhile idle out.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from proxy.state.claims import Ask
from proxy.state.redis.link import ERRORS, RedisLink
from proxy.state.redis.topology import ScriptBatch, reply_text, slot_prefix

log = logging.getLogger("prefixgate.admission")

PURGE_BATCH = 64
#: Seconds the room channel's listener blocks per read (then checks whether its link closed).
LISTEN_S = 1.0
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
#: sessions per rank (-1: no cap), then rank, budget (-1: none) pairs. Returns the ranks granted.
RESERVE = (
    _COMMON
    + """
local now, key = tonumber(ARGV[1]), ARGV[4]
local body, head, head_tokens = tonumber(ARGV[5]), ARGV[6], tonumber(ARGV[7])
local cap = tonumber(ARGV[8])
for _, k in ipairs(redis.call('ZRANGEBYSCORE', E, '-inf', now, 'LIMIT', 0, %(batch)d)) do
  drop_reservation(k)
end
for _, k in ipairs(redis.call('ZRANGEBYSCORE', S, '-inf', now - tonumber(ARGV[3]), 'LIMIT', 0, %(batch)d)) do
  drop_claim(k)
end
drop_reservation(key)
drop_claim(key)
local granted, parts = {}, {}
for i = 9, #ARGV, 2 do
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
if #parts == 0 then return granted end
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


def admission_keys(client: Any, prefix: str, names: Sequence[str]) -> list[str]:
    """The keys ``names`` under ``{prefix}:admission:`` on ``client``'s Redis, all in one slot."""
    base = slot_prefix(f"{prefix}:admission", client) + ":"
    return [base + name for name in names]


def room_channel(client: Any, prefix: str = "prefixgate") -> str:
    """The channel on which what may free room (a claim, a release) is said, in the claims' slot (a
    cluster's pub/sub reaches every node)."""
    return admission_keys(client, prefix, ("room",))[0]


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
        self.channel = room_channel(link.client, prefix)
        client = link.client
        self._reserve = client.register_script(RESERVE)
        self._claim = client.register_script(CLAIM)
        self._release = client.register_script(RELEASE)
        #: The claims this replica made last, per session: what it pushes back when Redis returns.
        self._mine: dict[str, Claim] = {}
        self._shared = True
        self._on_state = on_state
        self._wakes: list[Callable[[], None]] = []
        self._listener: threading.Thread | None = None
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
        if not ask.budgets:
            return frozenset()
        if not self.link.available():
            self._local("its circuit is open")
            return frozenset(ask.budgets)
        args: list[str | int | float] = [
            repr(self.clock()),
            repr(ask.expires_in),
            repr(ask.idle_ttl),
            ask.key,
            max(ask.body, 0),
            ask.head or "-",
            ask.head_tokens if ask.head else 0,
            -1 if ask.max_sessions is None else ask.max_sessions,
        ]
        for rank, budget in ask.budgets.items():
            args += [rank, -1 if budget is None else budget]
        try:
            granted = self._reserve(keys=self.keys, args=args)
        except ERRORS as exc:
            self.link.failed(exc)
            self._local(exc)
            return frozenset(ask.budgets)
        return frozenset(reply_text(r) for r in granted)

    def claim(self, key: str, rank: str, body: int, head: str | None, head_tokens: int) -> None:
        claim = (rank, max(body, 0), head or "-", head_tokens if head else 0)
        self._mine[key] = claim
        args: list[str | int] = [repr(self.clock()), key, *claim, self.channel]
        self.link.submit(lambda: self._claim(keys=self.keys, args=args))

    def release(self, key: str) -> None:
        self._mine.pop(key, None)
        self.link.submit(lambda: self._release(keys=self.keys, args=[key, self.channel]))

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
                log.debug("admission: room channel lost (%s); subscribing again", exc)
                time.sleep(self.link.retry_interval)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()

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
