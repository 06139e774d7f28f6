-- What an answer's head says about a model endpoint's limits (see llm/limits.py), learnt as
-- soon as it arrives. KEYS as model_take.lua. ARGV[1]: now, [2]: 1 if the provider refused
-- for its rate limit (429) or overload (529), else 0, [3]: seconds until its limit resets
-- ('' : it did not say), [4]: requests it says remain until then ('' : it did not say),
-- [5]: the request's number (model_take.lua; 0: unknown). Returns the pause, in ms, now in
-- force (0: none).
local now, refused = tonumber(ARGV[1]), ARGV[2] == '1'
local reset, remaining = tonumber(ARGV[3]), tonumber(ARGV[4])
local s = redis.call('HMGET', KEYS[1], 'pause_until', 'cap')
local pause, cap = tonumber(s[1]) or 0, tonumber(s[2])
redis.call('HDEL', KEYS[1], 'probe_until')  -- the count is back (or the provider gives none)
if refused then
  redis.call('HINCRBY', KEYS[1], 'refused', 1)
  local until_ = now + (reset or 1)
  if until_ > pause then
    pause = until_
    redis.call('HSET', KEYS[1], 'pause_until', tostring(pause))
  end
  -- halve what may fly (at least one): the pause ends with a trickle, not a storm
  local flying = redis.call('ZCARD', KEYS[2])
  local half = math.max(1, math.floor(math.min(cap or flying, flying) / 2))
  redis.call('HSET', KEYS[1], 'cap', tostring(half))
end
if remaining and reset then
  -- the provider counted up to this request: those sent after it are not in its count yet
  local number, after = tonumber(ARGV[5]) or 0, 0
  if number > 0 then
    after = math.max(0, tonumber(redis.call('HGET', KEYS[1], 'requests') or '0') - number)
  end
  redis.call('HSET', KEYS[1], 'budget', tostring(remaining - after),
             'budget_reset', tostring(now + reset))
end
if pause > now then return math.ceil((pause - now) * 1000) end
return 0
