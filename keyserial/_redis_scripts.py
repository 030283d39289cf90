"""The Lua scripts of the Redis backend: a ticket queue per key, a leased holder, fences.

All keys of one user key share a hash tag, so each script touches one slot and
also runs on Redis Cluster. Per user key:

* ``tickets`` — counter handing out tickets in arrival order;
* ``queue`` — list of waiting tickets, oldest first;
* ``alive`` — sorted set: waiting ticket -> time (ms) until which its waiter is alive;
* ``holder`` — ``"<ticket>:<fence>"`` of the current turn, expiring with its lease;
* ``fence`` — the last fence handed out.

A fence is ``max(last fence + 1, server time in µs)``: strictly increasing per
key, and still larger than every earlier fence after Redis lost all its data.
"""

from __future__ import annotations

# KEYS: tickets, queue, alive, holder, fence.  ARGV vary per script; the last ARGV of each
# script that can grant are: lease_ms, channel, encoded key.
_ADVANCE = """
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function advance(lease_ms, channel, encoded)
  if redis.call('EXISTS', KEYS[4]) == 1 then
    return nil
  end
  local now = now_ms()
  while true do
    local head = redis.call('LINDEX', KEYS[2], 0)
    if not head then
      return nil
    end
    redis.call('LPOP', KEYS[2])
    local alive = redis.call('ZSCORE', KEYS[3], head)
    redis.call('ZREM', KEYS[3], head)
    if alive and tonumber(alive) >= now then
      local t = redis.call('TIME')
      local micros = tonumber(t[1]) * 1000000 + tonumber(t[2])
      local last = tonumber(redis.call('GET', KEYS[5]) or '0')
      local fence = math.max(last + 1, micros)
      local text = string.format('%.0f', fence)
      redis.call('SET', KEYS[5], text)
      redis.call('SET', KEYS[4], head .. ':' .. text, 'PX', lease_ms)
      redis.call('PUBLISH', channel, encoded .. '|' .. head .. '|' .. text)
      return {head, text}
    end
  end
end
"""

# ARGV: waiter_lease_ms, lease_ms, channel, encoded key -> {ticket, fence or ''}
ACQUIRE = (
    _ADVANCE
    + """
local ticket = tostring(redis.call('INCR', KEYS[1]))
redis.call('RPUSH', KEYS[2], ticket)
redis.call('ZADD', KEYS[3], now_ms() + tonumber(ARGV[1]), ticket)
local granted = advance(tonumber(ARGV[2]), ARGV[3], ARGV[4])
if granted and granted[1] == ticket then
  return {ticket, granted[2]}
end
return {ticket, ''}
"""
)

# ARGV: ticket, waiter_lease_ms, lease_ms, channel, encoded key
#   -> {'granted', fence} | {'waiting', ''} | {'lost', ''} (the ticket is gone: register again)
POLL = (
    _ADVANCE
    + """
local ticket = ARGV[1]
local holder = redis.call('GET', KEYS[4])
if holder and string.sub(holder, 1, string.len(ticket) + 1) == ticket .. ':' then
  return {'granted', string.sub(holder, string.len(ticket) + 2)}
end
if not redis.call('LPOS', KEYS[2], ticket) then
  return {'lost', ''}
end
redis.call('ZADD', KEYS[3], 'XX', now_ms() + tonumber(ARGV[2]), ticket)
local granted = advance(tonumber(ARGV[3]), ARGV[4], ARGV[5])
if granted and granted[1] == ticket then
  return {'granted', granted[2]}
end
return {'waiting', ''}
"""
)

# ARGV: ticket, lease_ms, channel, encoded key -> 1 if the ticket held the turn, else 0.
# Either way the ticket leaves the queue and the next live waiter gets the turn.
RELEASE = (
    _ADVANCE
    + """
local ticket = ARGV[1]
local held = 0
local holder = redis.call('GET', KEYS[4])
if holder and string.sub(holder, 1, string.len(ticket) + 1) == ticket .. ':' then
  redis.call('DEL', KEYS[4])
  held = 1
else
  redis.call('LREM', KEYS[2], 0, ticket)
  redis.call('ZREM', KEYS[3], ticket)
end
advance(tonumber(ARGV[2]), ARGV[3], ARGV[4])
return held
"""
)

# ARGV: "<ticket>:<fence>", lease_ms -> 1 if the lease was extended, 0 if it was lost.
RENEW = """
if redis.call('GET', KEYS[4]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[4], ARGV[2])
  return 1
end
return 0
"""
