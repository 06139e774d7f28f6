-- Give back a model endpoint's request slot and learn from the answer (see llm/limits.py).
-- KEYS as model_take.lua. ARGV[1]: holder, [2]: now, [3]: tokens taken at the start, [4]: the
-- tokens the answer used ('' : unknown), [5]: tokens per minute ('' : not declared),
-- [6]: 1 if the provider refused for its rate limit (429) or overload (529), else 0,
-- [7]: seconds until the provider's limit resets ('' : it did not say), [8]: requests the
-- provider says remain until then ('' : it did not say), [9]: the most requests in flight
-- the adaptive limit allows (its ceiling). Returns the pause, in ms, now in force (0: none).
local holder, now = ARGV[1], tonumber(ARGV[2])
local taken, used, tpm = tonumber(ARGV[3]) or 0, tonumber(ARGV[4]), tonumber(ARGV[5])
local refused, reset, remaining = ARGV[6] == '1', tonumber(ARGV[7]), tonumber(ARGV[8])
local ceiling = tonumber(ARGV[9])
local flying = redis.call('ZCARD', KEYS[2])
redis.call('ZREM', KEYS[2], holder)
local s = redis.call('HMGET', KEYS[1], 'tokens', 'pause_until', 'cap')
local cap = tonumber(s[3])
if tpm and used and s[1] then  -- the estimate taken at the start, corrected
  local capacity = math.max(tpm / 6, taken)
  redis.call('HSET', KEYS[1], 'tokens', tostring(math.min(capacity, tonumber(s[1]) + taken - used)))
end
local pause = tonumber(s[2]) or 0
if refused then
  redis.call('HINCRBY', KEYS[1], 'refused', 1)
  local until_ = now + (reset or 1)
  if until_ > pause then
    pause = until_
    redis.call('HSET', KEYS[1], 'pause_until', tostring(pause))
  end
  -- halve what may fly (at least one): the pause ends with a trickle, not a storm
  local half = math.max(1, math.floor(math.min(cap or flying, flying) / 2))
  redis.call('HSET', KEYS[1], 'cap', tostring(half))
elseif cap then  -- one more in flight per window of successes, up to the ceiling
  cap = cap + 1 / math.max(1, math.floor(cap))
  if cap >= ceiling then redis.call('HDEL', KEYS[1], 'cap')
  else redis.call('HSET', KEYS[1], 'cap', tostring(cap)) end
end
if remaining and reset then
  redis.call('HSET', KEYS[1], 'budget', tostring(remaining), 'budget_reset', tostring(now + reset))
end
if pause > now then return math.ceil((pause - now) * 1000) end
return 0
