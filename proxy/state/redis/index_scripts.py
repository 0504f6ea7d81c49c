"""The Lua scripts of the Redis prefix index (``index.py``): one round trip each, run atomically.

Scores are microseconds from a shared tick (``KEYS[2]``), so a chain's blocks get distinct scores,
its head highest; ``ZPOPMIN`` past capacity therefore drops the least recent chain's tail first.
"""

from __future__ import annotations

#: Members per ZADD/ZREM call inside the scripts (Lua's unpack limit is about 8,000 values).
WRITE_CHUNK = 2000

#: A chain whose recorded prefix has sunk past this share of the rank's capacity (or of the TTL)
#: is written whole again rather than only its new tail: its scores then stay within a quarter of
#: the pool's turnover of the truth, which orders evictions as well as the mirror's own estimate.
REFRESH_SHARE = 4


def _chunked(command: str, score: str | None = None) -> str:
    """Lua that calls ``command`` (its leading values: ``'ZREM', KEYS[1]``) over the ``n`` 8-byte
    keys of ``blob``, at most ``WRITE_CHUNK`` values a call: each key alone, or preceded by
    ``score`` (Lua over ``idx``, the key's 1-based index) when one is given."""
    width = 1 if score is None else 2
    fill = "args[j] = key" if score is None else f"args[2 * j - 1] = {score}\n    args[2 * j] = key"
    return f"""local i = 0
while i < n do
  local m = math.min({WRITE_CHUNK // width}, n - i)
  local args = {{}}
  for j = 1, m do
    local idx = i + j
    local key = string.sub(blob, idx * 8 - 7, idx * 8)
    {fill}
  end
  redis.call({command}, unpack(args))
  i = i + m
end
"""


#: Lua: ``blob`` (ARGV[1]) and ``n``, its count of 8-byte keys.
_BLOB = """
local blob = ARGV[1]
local n = #blob / 8
"""

#: Lua: ``now``, Redis's clock in microseconds.
_NOW = """local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
"""


#: Lua: past ``cap`` (>= 0) entries, drop the least recent.
_TRIM_TO_CAPACITY = """if cap >= 0 then
  local excess = redis.call('ZCARD', KEYS[1]) - cap
  if excess > 0 then redis.call('ZPOPMIN', KEYS[1], excess) end
end
"""

# Per rank, the leading blocks held, then how many of those the rank holds in CPU memory only.
#   KEYS: lru:{rank} x nb, cpu:{rank} x nb, [sess:{key}]   ARGV: blob, TTL us, nb
#   returns: held per rank (nb), the session's rank (or nil), CPU-only per rank (nb)
# A rank's CPU-only blocks are its match's last (the GPU evicts a chain's tail first): bisected too.
MATCH = (
    _BLOB
    + _NOW
    + """local cutoff = now - tonumber(ARGV[2])
local nb = tonumber(ARGV[3])
local out = {}
local function held(key, i)
  local s = redis.call('ZSCORE', key, string.sub(blob, i * 8 - 7, i * 8))
  return s and tonumber(s) >= cutoff
end
local function offloaded(key, i)
  return redis.call('SISMEMBER', key, string.sub(blob, i * 8 - 7, i * 8)) == 1
end
for k = 1, nb do
  local key = KEYS[k]
  local lo, hi = 0, n + 1
  -- gallop: 1, 2, 4, ... until a miss, then bisect between the last hit and that miss
  local probe = 1
  while probe <= n do
    if held(key, probe) then lo = probe; probe = probe * 2 else hi = probe; break end
  end
  if probe > n and lo < n then
    if held(key, n) then lo = n else hi = n end
  end
  while hi - lo > 1 do
    local mid = math.floor((lo + hi) / 2)
    if held(key, mid) then lo = mid else hi = mid end
  end
  out[k] = lo
  local cpu = KEYS[nb + k]
  local off = 0
  if lo > 0 and offloaded(cpu, lo) then
    -- the first CPU-only block: in (a, b], block a on the GPU (0: none), block b CPU-only
    local a, b = 0, lo
    while b - a > 1 do
      local mid = math.floor((a + b) / 2)
      if offloaded(cpu, mid) then b = mid else a = mid end
    end
    off = lo - b + 1
  end
  out[nb + 1 + k] = off
end
local session = false
if #KEYS > 2 * nb then session = redis.call('GET', KEYS[2 * nb + 1]) end
out[nb + 1] = session
return out
"""
)

# A rank's blocks held in CPU memory only (``cpu:{rank}``, a set of 8-byte keys): KV events moved
# them there (a GPU removal of a block with a CPU copy) or back (a reload, an eviction).
#   KEYS: cpu:{rank}   ARGV: keys added, keys removed, '1': replace the whole set, TTL ms
TIERS = """
local function apply(cmd, blob)
  local n = #blob / 8
  local i = 0
  while i < n do
    local m = math.min(%(chunk)d, n - i)
    local args = {}
    for j = 1, m do
      local idx = i + j
      args[j] = string.sub(blob, idx * 8 - 7, idx * 8)
    end
    redis.call(cmd, KEYS[1], unpack(args))
    i = i + m
  end
end
if ARGV[3] == '1' then redis.call('DEL', KEYS[1]) end
apply('SREM', ARGV[2])
apply('SADD', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
""".replace("%(chunk)d", str(WRITE_CHUNK))

RECORD = (
    _BLOB
    + """local cap = tonumber(ARGV[2])
local ttl = tonumber(ARGV[3])
"""
    + _NOW
    + """local start = math.max(now, tonumber(redis.call('GET', KEYS[2]) or '0') + 1)
redis.call('SET', KEYS[2], string.format('%d', start + n))
"""
    + _chunked("'ZADD', KEYS[1]", "start + n - idx")
    + """redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%d', now - ttl))
"""
    + _TRIM_TO_CAPACITY
    + """redis.call('PEXPIRE', KEYS[1], math.floor(ttl / 1000))
return n
"""
)

REMOVE = (
    _BLOB
    + _chunked("'ZREM', KEYS[1]")
    + """return n
"""
)

# Record a chain whose first blocks Redis already holds: only the new tail is written, with scores
# just below the last held block's (the chain keeps one recency, tail below head), so a returning
# session's turn costs O(new blocks) instead of rewriting its whole conversation. Returns -1, and
# writes nothing, when that block is gone or has sunk far enough that the whole chain must be
# rewritten to keep its place in the LRU order (the caller then runs RECORD).
#   KEYS: lru:{rank}   ARGV: tail blob, held block key, held blocks, capacity (-1: none), TTL us
EXTEND = (
    _BLOB
    + """local held = tonumber(ARGV[3])
local cap = tonumber(ARGV[4])
local ttl = tonumber(ARGV[5])
local score = redis.call('ZSCORE', KEYS[1], ARGV[2])
if not score then return -1 end
score = tonumber(score)
"""
    + _NOW
    + """if now - score > ttl / %(share)d then return -1 end
if cap >= 0 then
  local newer = redis.call('ZREVRANK', KEYS[1], ARGV[2]) - (held - 1)
  if newer > cap / %(share)d then return -1 end
end
"""
    + _chunked("'ZADD', KEYS[1], 'GT'", "score - idx")
    + """if n > 0 then
"""
    + _TRIM_TO_CAPACITY
    + """end
return n
"""
).replace("%(share)d", str(REFRESH_SHARE))

# Bind a session to a rank, first writer wins: the binding is written when the key is unset (a new
# session, or a binding Redis lost), still holds what the caller's lookup saw, or holds this rank
# already; otherwise another replica bound it since that lookup, and its rank is returned for the
# caller to adopt (its TTL refreshed: the session is live).
#   KEYS: sess:{key}   ARGV: rank, the rank the caller's lookup saw ('' for none), TTL seconds
BIND = """
local current = redis.call('GET', KEYS[1])
if not current or current == ARGV[2] or current == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
  return ARGV[1]
end
redis.call('EXPIRE', KEYS[1], ARGV[3])
return current
"""

#: The lease on writing an event-fed rank's mirror (KEYS[1], expiring) and its last holder
#: (KEYS[2], kept): ARGV replica id, lease ms. 0: another replica holds it; 1: this one does (renewed,
#: retaken while nobody else wrote since, or the first writer: a Redis that forgot gets every mirror
#: pushed back by ``resync``); 2: taken over from another: the taker pushes its mirror of the rank,
#: since it wrote none of the events meanwhile.
LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
if holder then return 1 end
local last = redis.call('GET', KEYS[2])
redis.call('SET', KEYS[2], ARGV[1])
if not last or last == ARGV[1] then return 1 end
return 2
"""
