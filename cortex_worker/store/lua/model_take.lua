-- Take a request slot of a model endpoint, or say how long to wait (see llm/limits.py). No
-- prelude: these are the endpoint's keys. KEYS[1]: state (hash), [2]: in flight (zset holder ->
-- lease end), [3]: waiting (zset holder -> arrival), [4]: waiters (hash holder -> tenant|last
-- poll), [5]: served (hash tenant -> when it last got a slot).
-- ARGV[1]: holder, [2]: tenant, [3]: now, [4]: lease end, [5]: requests per minute, [6]: tokens
-- per minute, [7]: max concurrent ('' : not declared), [8]: the request's estimated tokens,
-- [9]: seconds after which a waiter that stopped asking loses its place.
-- Returns {1, tokens taken, the request's number} when the slot is taken (the number counts
-- the endpoint's requests: model_give.lua tells from it which came after), else {0, ms to
-- wait (-1: unknown, ask again soon), reason}. Waiters are served in turn by tenant (the one served longest ago
-- first), in arrival order within a tenant; a tenant alone gets every slot.
local holder, tenant, now = ARGV[1], ARGV[2], tonumber(ARGV[3])
local rpm, tpm, maxc = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local need, stale = tonumber(ARGV[8]) or 0, tonumber(ARGV[9])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)  -- a dead worker's slot frees itself
if redis.call('ZSCORE', KEYS[2], holder) then return {1, 0, 0} end
redis.call('ZADD', KEYS[3], 'NX', now, holder)
redis.call('HSET', KEYS[4], holder, tenant .. '|' .. ARGV[3])

local s = redis.call('HMGET', KEYS[1], 'pause_until', 'budget', 'budget_reset', 'tat', 'tokens',
                     'tokens_at', 'cap', 'probe_until')
local pause, budget, budget_reset = tonumber(s[1]) or 0, tonumber(s[2]), tonumber(s[3]) or 0
local tat, level, level_at, cap = tonumber(s[4]) or 0, tonumber(s[5]), tonumber(s[6]) or now, tonumber(s[7])
if pause > now then return {0, math.ceil((pause - now) * 1000), 'paused'} end
local counted = budget and budget_reset > now  -- the provider said how many remain
if counted and budget <= 0 then
  return {0, math.ceil((budget_reset - now) * 1000), 'remaining'}
end
-- The provider counts, and its count has reset since it last said: one request (a probe)
-- brings the new count back (model_answer.lua) before the others go.
local probing = budget and not counted
if probing and (tonumber(s[8]) or 0) > now then return {0, -1, 'remaining'} end
local spacing = rpm and 60 / rpm
if rpm and tat > now then return {0, math.ceil((tat - now) * 1000), 'requests_per_minute'} end
local capacity = 0
if tpm then
  capacity = math.max(tpm / 6, need)  -- ten seconds of tokens, or one request's
  level = math.min(capacity, (level or capacity) + (now - level_at) * tpm / 60)
  if level < need then
    return {0, math.ceil((need - level) / (tpm / 60) * 1000), 'tokens_per_minute'}
  end
end
local limit = maxc
if cap and (not limit or cap < limit) then limit = math.floor(cap) end
local free = -1  -- no concurrency limit: one at a time only where a rate applies
if limit then
  free = limit - redis.call('ZCARD', KEYS[2])
  if free <= 0 then return {0, -1, 'max_concurrent'} end
end
if rpm or tpm or counted or probing then free = 1 end

-- Whose turn: waiters that still ask, by (their tenant's last slot, arrival).
local order = {}
local entries = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
for i = 1, #entries, 2 do
  local who, arrived = entries[i], tonumber(entries[i + 1])
  local info = redis.call('HGET', KEYS[4], who)
  local t, polled = '', 0
  if info then
    local bar = string.find(info, '|', 1, true)
    t, polled = string.sub(info, 1, bar - 1), tonumber(string.sub(info, bar + 1))
  end
  if polled < now - stale then
    redis.call('ZREM', KEYS[3], who)
    redis.call('HDEL', KEYS[4], who)
  else
    table.insert(order, {tonumber(redis.call('HGET', KEYS[5], t) or '0'), arrived, who})
  end
end
if free > 0 and #order > free then
  table.sort(order, function(a, b)
    if a[1] ~= b[1] then return a[1] < b[1] end
    if a[2] ~= b[2] then return a[2] < b[2] end
    return a[3] < b[3]
  end)
  local mine = false
  for i = 1, free do if order[i][3] == holder then mine = true end end
  if not mine then return {0, -1, 'queue'} end
end

redis.call('ZADD', KEYS[2], ARGV[4], holder)
redis.call('ZREM', KEYS[3], holder)
redis.call('HDEL', KEYS[4], holder)
redis.call('HSET', KEYS[5], tenant, ARGV[3])
local fields = {'granted_at', ARGV[3]}
if rpm then  -- a request a little late does not push the next one back (no drift)
  table.insert(fields, 'tat'); table.insert(fields, tostring(math.max(tat, now - spacing / 4) + spacing))
end
if probing then table.insert(fields, 'probe_until'); table.insert(fields, tostring(now + 10)) end
if tpm then
  table.insert(fields, 'tokens'); table.insert(fields, tostring(level - need))
  table.insert(fields, 'tokens_at'); table.insert(fields, ARGV[3])
end
if counted then
  table.insert(fields, 'budget'); table.insert(fields, tostring(budget - 1))
end
redis.call('HSET', KEYS[1], unpack(fields))
local number = redis.call('HINCRBY', KEYS[1], 'requests', 1)
return {1, tpm and need or 0, number}
