"""The Lua scripts of the Redis backend: a ticket queue per key, a leased holder, fences.

Each script is given one key name, the user key's *base* ``keyserial:{<namespace>:<key>}``,
and derives the names of its parts from it by appending a suffix. The braces make the base
a hash tag, so every part lives in the base's slot and the scripts also run on Redis
Cluster. One name instead of five also keeps each call short: a hand-off sends two scripts,
and each argument is one more to encode, send and parse. Per user key:

* ``<base>:queue`` — list of waiting tickets, oldest first. A ticket is ``"<n>@<listener>"``,
  made by the waiting process: ``n`` counts that listener's tickets and the listener is a
  random name of one process's event loop, so a ticket never repeats, whatever Redis forgets.
  The grant is published on the listener's channel ``keyserial:grants:<listener>`` alone;
* ``<base>:alive`` — sorted set: waiting ticket -> time (ms) until which its waiter is alive
  (two leases after its last poll, so a live waiter keeps its place through a stall of the
  server shorter than five thirds of a lease);
* ``<base>:holder`` — ``"<ticket>:<fence>"`` of the current turn, expiring with its lease;
* ``<base>:fence`` — the last fence handed out, kept for an hour after it;
* ``<base>:was`` — the ticket of the last grant until it is released: found when the turn
  is free, it says that the holder's lease ran out instead;
* ``<base>:gone:<ticket>`` — a ticket withdrawn before its registration reached Redis (the
  waiter timed out or was cancelled while Redis stalled): the late registration is refused.

The queue and the heartbeats disappear when empty, or an hour after the last waiter registered
or polled (all its waiters died), and the holder with its lease, so an unused key leaves
nothing in Redis after an hour.

A grant message is ``"<base>|<ticket>|<fence>"``. A fence is ``max(last fence + 1,
server time in µs)``: strictly increasing per key, and still larger than every earlier
fence after Redis lost all its data.
"""

from __future__ import annotations

# Every grant is on a hand-off's critical path: each script reads the clock at most once
# and makes as few calls as it can.
_GRANT = """
local base = KEYS[1]
local QUEUE, ALIVE = base .. ':queue', base .. ':alive'
local HOLDER, FENCE, WAS = base .. ':holder', base .. ':fence', base .. ':was'
-- How long a key's counters outlive its last grant, so that Redis keeps nothing for keys
-- that are no longer used. Safe to lose: a fence is never below the clock, and tickets are
-- made unique by their processes.
local RETAIN_MS = 3600000
-- A waiter's heartbeat lasts this many leases after its last poll (it polls every third).
local ALIVE_LEASES = 2

local function grant(ticket, t, lease_ms)
  -- The clock in µs is the fence unless it is not above the last one (a clock step back,
  -- or grants within one µs): one SET ... GET in the common case instead of GET and SET.
  local text = t[1] .. string.format('%06d', tonumber(t[2]))
  local last = redis.call('SET', FENCE, text, 'PX', RETAIN_MS, 'GET')
  if last and tonumber(last) >= tonumber(text) then
    text = string.format('%.0f', tonumber(last) + 1)
    redis.call('SET', FENCE, text, 'PX', RETAIN_MS)
  end
  redis.call('SET', HOLDER, ticket .. ':' .. text, 'PX', lease_ms)
  redis.call('SET', WAS, ticket, 'PX', RETAIN_MS)
  return text
end

local function now_ms(t)
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Grant the free turn to the oldest live waiter, skipping dead ones; tell it, unless it is
-- own, who learns from the script's reply. Returns the fence granted to own. t is the TIME
-- already read, or nil; caller is a ticket of the process running the script ('' if none).
local function advance(t, own, lease_ms, caller)
  local now
  local was = redis.call('GET', WAS)
  if was then
    -- The last holder's lease ran out without a release: its process died or stopped. Its
    -- other tickets are dropped rather than granted to it one lease at a time; if it lives,
    -- it finds them lost and registers them again. Not when it is the one asking.
    redis.call('DEL', WAS)
    local listener = string.match(was, '@(.*)$')
    if listener and string.match(caller, '@(.*)$') ~= listener then
      for _, ticket in ipairs(redis.call('LRANGE', QUEUE, 0, -1)) do
        if string.match(ticket, '@(.*)$') == listener then
          redis.call('LREM', QUEUE, 0, ticket)
          redis.call('ZREM', ALIVE, ticket)
        end
      end
    end
  end
  while true do
    local head = redis.call('LPOP', QUEUE)
    if not head then
      return nil
    end
    t = t or redis.call('TIME')  -- read only when there is someone to grant to
    now = now or now_ms(t)
    local alive = redis.call('ZSCORE', ALIVE, head)
    redis.call('ZREM', ALIVE, head)
    if alive and tonumber(alive) >= now then
      local text = grant(head, t, lease_ms)
      if head == own then
        return text
      end
      local listener = string.match(head, '@(.*)$') or ''
      redis.call('PUBLISH', 'keyserial:grants:' .. listener, base .. '|' .. head .. '|' .. text)
      return nil
    end
  end
end

-- The waiters' queue and heartbeats outlive the last waiter to register or poll by an hour:
-- if every process waiting on a key dies and no one uses the key again, nothing stays.
local function retain_waiters()
  redis.call('PEXPIRE', QUEUE, RETAIN_MS)
  redis.call('PEXPIRE', ALIVE, RETAIN_MS)
end

local function holds(holder, ticket)
  return holder and string.sub(holder, 1, string.len(ticket) + 1) == ticket .. ':'
end
"""

# ARGV: lease_ms, ticket[, '1' to queue it first] -> fence if granted at once, '' if queued,
# '-' if it was withdrawn. A ticket queued first is a call that was granted the turn but
# found, before starting, that the grant's lease may have run out (its process was paused):
# it waits again in the place it had.
ACQUIRE = (
    _GRANT
    + """
local lease_ms, ticket, first = tonumber(ARGV[1]), ARGV[2], ARGV[3] == '1'
if redis.call('EXISTS', base .. ':gone:' .. ticket) == 1 then
  return '-'
end
local t = redis.call('TIME')
local held = redis.call('EXISTS', HOLDER) == 1
if not held and redis.call('LLEN', QUEUE) == 0 then
  return grant(ticket, t, lease_ms)
end
redis.call(first and 'LPUSH' or 'RPUSH', QUEUE, ticket)
redis.call('ZADD', ALIVE, now_ms(t) + ALIVE_LEASES * lease_ms, ticket)
retain_waiters()
if not held then
  -- The holder's lease ran out with tickets waiting: serve them first.
  local fence = advance(t, ticket, lease_ms, ticket)
  if fence then
    return fence
  end
end
return ''
"""
)

# ARGV: ticket, lease_ms
#   -> {'granted', fence} | {'waiting', ''} | {'lost', ''} (the ticket is gone: register again)
POLL = (
    _GRANT
    + """
local ticket, lease_ms = ARGV[1], tonumber(ARGV[2])
local holder = redis.call('GET', HOLDER)
if holds(holder, ticket) then
  return {'granted', string.sub(holder, string.len(ticket) + 2)}
end
if not redis.call('LPOS', QUEUE, ticket) then
  return {'lost', ''}
end
local t = redis.call('TIME')
redis.call('ZADD', ALIVE, 'XX', now_ms(t) + ALIVE_LEASES * lease_ms, ticket)
retain_waiters()
if not holder then
  local fence = advance(t, ticket, lease_ms, ticket)
  if fence then
    return {'granted', fence}
  end
end
return {'waiting', ''}
"""
)

# ARGV: ticket, lease_ms -> 1 if the ticket held the turn, else 0.
# Either way the ticket leaves the queue and the next live waiter gets the turn; a ticket
# found nowhere may still be on its way (its registration delayed by a stall): it is marked
# gone, so that its registration is refused when it arrives.
RELEASE = (
    _GRANT
    + """
local ticket, lease_ms = ARGV[1], tonumber(ARGV[2])
local holder = redis.call('GET', HOLDER)
if holds(holder, ticket) then
  redis.call('DEL', HOLDER)
  redis.call('DEL', WAS)
  advance(nil, '', lease_ms, ticket)
  return 1
end
local removed = redis.call('LREM', QUEUE, 0, ticket)
redis.call('ZREM', ALIVE, ticket)
if removed == 0 then
  redis.call('SET', base .. ':gone:' .. ticket, 1, 'PX', RETAIN_MS)
end
if not holder then
  advance(nil, '', lease_ms, ticket)
end
return 0
"""
)

# ARGV: "<ticket>:<fence>", lease_ms -> 1 if the lease was extended, 0 if it was lost.
RENEW = """
local holder = KEYS[1] .. ':holder'
if redis.call('GET', holder) == ARGV[1] then
  redis.call('PEXPIRE', holder, ARGV[2])
  return 1
end
return 0
"""

#: The first ticket of a REQUEUE when the process's earliest waiting call is not among them.
EARLIER_ELSEWHERE = "!"

# ARGV: lease_ms, ticket... (one process's waiting tickets of the key, in call order) ->
# {Redis's clock in µs, the ticket that keeps its turn or ''}: any later grant of a ticket
# registered again has a fence at least that clock (a fence below it was granted before, to
# the registration that was lost or taken back). Redis lost one of them (a restart, a
# pause past its heartbeat), or granted one whose call cannot take it up (an earlier one of
# the process waits): all are taken out and put back together, in the order given, where
# the first of them still queued stood (first if a later one holds the turn, last if none is
# queued), so that none is granted before an earlier one. The first ticket, if it holds the
# turn, keeps it; a ticket withdrawn meanwhile is left out. The first ticket may be
# EARLIER_ELSEWHERE: an earlier call of the process waits under a ticket not given
# (registered on its own, or still to be sent): then none given keeps the turn, and they
# are put back last if none is queued.
REQUEUE = (
    _GRANT
    + """
local lease_ms = tonumber(ARGV[1])
local holder = redis.call('GET', HOLDER)
local elsewhere = ARGV[2] == '"""
    + EARLIER_ELSEWHERE
    + """'
local first
local holding
for i = 2, #ARGV do
  if holds(holder, ARGV[i]) then
    if i == 2 then
      holding = ARGV[i]  -- the earliest call holds the turn: it takes it up
    else
      redis.call('DEL', HOLDER)  -- its call cannot take it up: the earliest one gets it
      redis.call('DEL', WAS)
      holder = false
      if not elsewhere then
        first = 0
      end
    end
  end
end
for i = 2, #ARGV do
  local at = redis.call('LPOS', QUEUE, ARGV[i])
  if at and (not first or at < first) then
    first = at
  end
end
local pivot = first and first > 0 and redis.call('LINDEX', QUEUE, first - 1)
local tickets = {}
for i = 2, #ARGV do
  local ticket = ARGV[i]
  redis.call('LREM', QUEUE, 0, ticket)
  if ticket ~= holding and not (elsewhere and i == 2)
      and redis.call('EXISTS', base .. ':gone:' .. ticket) == 0 then
    tickets[#tickets + 1] = ticket
  end
end
local t = redis.call('TIME')
for i, ticket in ipairs(tickets) do
  if not first then
    redis.call('RPUSH', QUEUE, ticket)
  elseif pivot then
    redis.call('LINSERT', QUEUE, 'AFTER', pivot, ticket)
    pivot = ticket
  else
    redis.call('LPUSH', QUEUE, tickets[#tickets + 1 - i])
  end
  redis.call('ZADD', ALIVE, now_ms(t) + ALIVE_LEASES * lease_ms, ticket)
end
if #tickets > 0 then
  retain_waiters()
  if not holder then
    advance(t, '', lease_ms, tickets[1])
  end
end
return {t[1] .. string.format('%06d', tonumber(t[2])), holding or ''}
"""
)
