"""The Lua scripts of the Redis backend: a ticket queue per key, a leased holder, fences.

All keys of one user key share a hash tag, so each script touches one slot and
also runs on Redis Cluster. Per user key:

* ``tickets`` — counter handing out tickets in arrival order;
* ``queue`` — list of waiting tickets, oldest first; a ticket is ``"<n>@<listener>"``,
  naming the process's grant listener, so a grant is published to that process alone;
* ``alive`` — sorted set: waiting ticket -> time (ms) until which its waiter is alive;
* ``holder`` — ``"<ticket>:<fence>"`` of the current turn, expiring with its lease;
* ``fence`` — the last fence handed out.

A fence is ``max(last fence + 1, server time in µs)``: strictly increasing per
key, and still larger than every earlier fence after Redis lost all its data.
"""

from __future__ import annotations

# KEYS: tickets, queue, alive, holder, fence.  ARGV vary per script; the last ARGV of each
# script that can grant are: lease_ms, channel prefix, encoded key. A grant is published on
# "<channel prefix><listener>" only: broadcasting it to every process of the queue made each
# of them read and drop every other process's grants. Every grant is on a hand-off's
# critical path, so each script reads the clock once and makes as few calls as it can.
_GRANT = """
local function grant(ticket, t, lease_ms)
  local micros = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local fence = math.max(tonumber(redis.call('GET', KEYS[5]) or '0') + 1, micros)
  local text = string.format('%.0f', fence)
  redis.call('SET', KEYS[5], text)
  redis.call('SET', KEYS[4], ticket .. ':' .. text, 'PX', lease_ms)
  return text
end

local function now_ms(t)
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Grant the free turn to the oldest live waiter, skipping dead ones; tell it, unless it is
-- the caller (own), who learns from the script's reply. Returns the fence granted to own.
local function advance(t, own, lease_ms, prefix, encoded)
  local now = now_ms(t)
  while true do
    local head = redis.call('LPOP', KEYS[2])
    if not head then
      return nil
    end
    local alive = redis.call('ZSCORE', KEYS[3], head)
    redis.call('ZREM', KEYS[3], head)
    if alive and tonumber(alive) >= now then
      local text = grant(head, t, lease_ms)
      if head == own then
        return text
      end
      local listener = string.match(head, '@(.*)$') or ''
      redis.call('PUBLISH', prefix .. listener, encoded .. '|' .. head .. '|' .. text)
      return nil
    end
  end
end
"""

# ARGV: waiter_lease_ms, lease_ms, channel prefix, encoded key, listener
#   -> {ticket, fence or ''}
ACQUIRE = (
    _GRANT
    + """
local ticket = redis.call('INCR', KEYS[1]) .. '@' .. ARGV[5]
local t = redis.call('TIME')
local held = redis.call('EXISTS', KEYS[4]) == 1
if not held and redis.call('LLEN', KEYS[2]) == 0 then
  return {ticket, grant(ticket, t, tonumber(ARGV[2]))}
end
redis.call('RPUSH', KEYS[2], ticket)
redis.call('ZADD', KEYS[3], now_ms(t) + tonumber(ARGV[1]), ticket)
if not held then
  -- The holder's lease ran out with tickets waiting: serve them first.
  local fence = advance(t, ticket, tonumber(ARGV[2]), ARGV[3], ARGV[4])
  if fence then
    return {ticket, fence}
  end
end
return {ticket, ''}
"""
)

# ARGV: ticket, waiter_lease_ms, lease_ms, channel prefix, encoded key
#   -> {'granted', fence} | {'waiting', ''} | {'lost', ''} (the ticket is gone: register again)
POLL = (
    _GRANT
    + """
local ticket = ARGV[1]
local holder = redis.call('GET', KEYS[4])
if holder and string.sub(holder, 1, string.len(ticket) + 1) == ticket .. ':' then
  return {'granted', string.sub(holder, string.len(ticket) + 2)}
end
if not redis.call('LPOS', KEYS[2], ticket) then
  return {'lost', ''}
end
local t = redis.call('TIME')
redis.call('ZADD', KEYS[3], 'XX', now_ms(t) + tonumber(ARGV[2]), ticket)
if not holder then
  local fence = advance(t, ticket, tonumber(ARGV[3]), ARGV[4], ARGV[5])
  if fence then
    return {'granted', fence}
  end
end
return {'waiting', ''}
"""
)

# ARGV: ticket, lease_ms, channel prefix, encoded key -> 1 if the ticket held the turn, else 0.
# Either way the ticket leaves the queue and the next live waiter gets the turn.
RELEASE = (
    _GRANT
    + """
local ticket = ARGV[1]
local holder = redis.call('GET', KEYS[4])
if holder and string.sub(holder, 1, string.len(ticket) + 1) == ticket .. ':' then
  redis.call('DEL', KEYS[4])
  advance(redis.call('TIME'), '', tonumber(ARGV[2]), ARGV[3], ARGV[4])
  return 1
end
redis.call('LREM', KEYS[2], 0, ticket)
redis.call('ZREM', KEYS[3], ticket)
if not holder then
  advance(redis.call('TIME'), '', tonumber(ARGV[2]), ARGV[3], ARGV[4])
end
return 0
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
