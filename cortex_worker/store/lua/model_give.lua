-- Give back a model endpoint's request slot (see llm/limits.py); what its answer said was
-- learnt when it arrived (model_answer.lua). KEYS as model_take.lua. ARGV[1]: holder,
-- [2]: tokens taken at the start, [3]: the tokens the answer used ('' : unknown), [4]: tokens
-- per minute ('' : not declared), [5]: 1 if the request was answered (2xx), [6]: the most
-- requests in flight the adaptive limit allows (its ceiling).
local holder, taken = ARGV[1], tonumber(ARGV[2]) or 0
local used, tpm = tonumber(ARGV[3]), tonumber(ARGV[4])
local answered, ceiling = ARGV[5] == '1', tonumber(ARGV[6])
redis.call('ZREM', KEYS[2], holder)
local level = tonumber(redis.call('HGET', KEYS[1], 'tokens') or '')
if tpm and used and level then  -- the estimate taken at the start, corrected
  local capacity = math.max(tpm / 6, taken)
  redis.call('HSET', KEYS[1], 'tokens', tostring(math.min(capacity, level + taken - used)))
end
local cap = tonumber(redis.call('HGET', KEYS[1], 'cap') or '')
if answered and cap then  -- one more in flight per window of successes, up to the ceiling
  cap = cap + 1 / math.max(1, math.floor(cap))
  if cap >= ceiling then redis.call('HDEL', KEYS[1], 'cap')
  else redis.call('HSET', KEYS[1], 'cap', tostring(cap)) end
end
return 0
