"""The Lua scripts of the Redis stream source: every read, ack and dead letter is fenced.

Each script gets one key name, the partition's *base* ``keyserial:{<namespace>:<partition>}``
(the same base the Redis backend's scripts use for the partition's turn), and derives the
names of the partition's parts from it, so they all share one hash slot:

* ``<base>:holder`` — the partition's owner, ``"<ticket>:<fence>"``, written by the Redis
  backend when it grants the turn and expiring with the owner's lease;
* ``<base>:stream`` — the partition's messages, read through the consumer group ``keyserial``;
* ``<base>:dead`` — messages that failed ``max_attempts`` times, or were handed out more
  than ``max_deliveries`` times, with their error.

A script runs only for the owner holding ``fence`` now: a consumer that lost its lease (paused,
cut off) can neither read new messages into its pending list, nor acknowledge, nor dead-letter
anything. Its reply is then ``'fenced'``.
"""

from __future__ import annotations

_OWNER = """
local base = KEYS[1]
local STREAM, DEAD, GROUP = base .. ':stream', base .. ':dead', 'keyserial'
local function owns(fence)
  local holder = redis.call('GET', base .. ':holder')
  if not holder then
    return false
  end
  local held = string.match(holder, ':(%d+)$')
  return held == fence
end
local function ensure_group()
  local ok = pcall(redis.call, 'XGROUP', 'CREATE', STREAM, GROUP, '0', 'MKSTREAM')
  return ok
end
"""

# ARGV: fence, consumer, start, count
#   -> {'fenced'} | {'ok', next_start, entries, deliveries}
# Moves up to ``count`` pending messages (of earlier owners, or of this consumer's own
# earlier turn) to ``consumer``, oldest first, with how often each was delivered before.
# Consumers left with nothing pending are removed, so that the group does not keep a
# consumer name per process that ever owned the partition.
CLAIM = (
    _OWNER
    + """
local fence, consumer, start, count = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if not owns(fence) then
  return {'fenced'}
end
ensure_group()
local reply = redis.call('XAUTOCLAIM', STREAM, GROUP, consumer, 0, start, 'COUNT', count)
local entries = reply[2]
local deliveries = {}
if #entries > 0 then
  local first, last = entries[1][1], entries[#entries][1]
  local counts = {}
  for _, row in ipairs(redis.call('XPENDING', STREAM, GROUP, first, last, #entries, consumer)) do
    counts[row[1]] = row[4]
  end
  for i, entry in ipairs(entries) do
    deliveries[i] = counts[entry[1]] or 1
  end
end
if reply[1] == '0-0' then
  for _, info in ipairs(redis.call('XINFO', 'CONSUMERS', STREAM, GROUP)) do
    local name, pending
    for i = 1, #info, 2 do
      if info[i] == 'name' then name = info[i + 1] end
      if info[i] == 'pending' then pending = info[i + 1] end
    end
    if name ~= consumer and pending == 0 then
      redis.call('XGROUP', 'DELCONSUMER', STREAM, GROUP, name)
    end
  end
end
return {'ok', reply[1], entries, deliveries}
"""
)

# ARGV: fence, consumer, id, deliveries, id, deliveries, ... -> {'fenced'} | {'ok'}
# Sets the delivery counts of messages the owner holds: a claim counted them, but they
# cannot have been running when their last owner stopped (see _redeliveries.py).
SET_DELIVERIES = (
    _OWNER
    + """
local fence, consumer = ARGV[1], ARGV[2]
if not owns(fence) then
  return {'fenced'}
end
for i = 3, #ARGV, 2 do
  redis.call('XCLAIM', STREAM, GROUP, consumer, 0, ARGV[i], 'RETRYCOUNT', ARGV[i + 1], 'JUSTID')
end
return {'ok'}
"""
)

# ARGV: fence, consumer, count -> {'fenced'} | {'ok', entries} | {'empty', last_id}
# ``last_id`` is the partition's newest message id: every message up to it has been read,
# so a blocking XREAD from it wakes on exactly the next one.
READ = (
    _OWNER
    + """
local fence, consumer, count = ARGV[1], ARGV[2], ARGV[3]
if not owns(fence) then
  return {'fenced'}
end
local reply = redis.call('XREADGROUP', 'GROUP', GROUP, consumer, 'COUNT', count,
                         'STREAMS', STREAM, '>')
if reply and #reply[1][2] > 0 then
  return {'ok', reply[1][2]}
end
local last = redis.call('XREVRANGE', STREAM, '+', '-', 'COUNT', 1)
return {'empty', (last[1] and last[1][1]) or '0-0'}
"""
)

# ARGV: fence, id... -> {'fenced'} | {'ok', lag}
# Acknowledges the finished messages, then trims what every message before the oldest still
# pending (or, with none pending, before the last one read) has become: acknowledged history.
ACK = (
    _OWNER
    + """
local fence = ARGV[1]
if not owns(fence) then
  return {'fenced'}
end
redis.call('XACK', STREAM, GROUP, unpack(ARGV, 2))
local summary = redis.call('XPENDING', STREAM, GROUP)
local lag, last = 0, nil
for _, info in ipairs(redis.call('XINFO', 'GROUPS', STREAM)) do
  local fields = {}
  for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
  if fields['name'] == GROUP then
    lag, last = fields['lag'] or 0, fields['last-delivered-id']
  end
end
local keep_from = summary[2] or last
if keep_from then
  redis.call('XTRIM', STREAM, 'MINID', '~', keep_from)
end
return {'ok', lag}
"""
)

# ARGV: fence, id, deliveries, error, field, value, ... -> {'fenced'} | {'ok', dead_id}
# Writes the message with its error to the dead-letter stream and acknowledges it, at once.
DEAD_LETTER = (
    _OWNER
    + """
local fence, id, deliveries, error = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if not owns(fence) then
  return {'fenced'}
end
local dead = redis.call('XADD', DEAD, '*', 'keyserial.id', id, 'keyserial.deliveries', deliveries,
                        'keyserial.error', error, unpack(ARGV, 5))
redis.call('XACK', STREAM, GROUP, id)
return {'ok', dead}
"""
)

# KEYS[1]: the members' sorted set. ARGV: member, ttl_ms, leaving ('1' or '0')
#   -> the live members, sorted.
# Membership uses Redis' clock, so machines with skewed clocks agree on who is alive.
MEMBERS = """
local members, member, ttl, leaving = KEYS[1], ARGV[1], tonumber(ARGV[2]), ARGV[3]
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if leaving == '1' then
  redis.call('ZREM', members, member)
else
  redis.call('ZADD', members, now + ttl, member)
  redis.call('PEXPIRE', members, ttl * 2)
end
redis.call('ZREMRANGEBYSCORE', members, '-inf', now - 1)
return redis.call('ZRANGE', members, 0, -1)
"""

# KEYS: base -> lag: the partition's messages not yet handed out to any consumer. The group's
# own count when Redis knows it; otherwise (entries deleted in between, as trimming does) the
# stream's length less its pending messages, which trimming keeps close (each step is O(1)).
LAG = """
local base = KEYS[1]
local STREAM, GROUP = base .. ':stream', 'keyserial'
if redis.call('EXISTS', STREAM) == 0 then
  return 0
end
for _, info in ipairs(redis.call('XINFO', 'GROUPS', STREAM)) do
  local fields = {}
  for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
  if fields['name'] == GROUP then
    if fields['lag'] then
      return fields['lag']
    end
    return math.max(0, redis.call('XLEN', STREAM) - fields['pending'])
  end
end
return redis.call('XLEN', STREAM)
"""
