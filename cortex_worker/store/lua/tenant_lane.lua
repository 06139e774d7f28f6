-- The lane of a tenant (see actions/fairness.py): the one it has, else the lane with the
-- fewest tenants (the lowest of those), lane 0 being the default tenant's. No prelude.
-- KEYS[1]: tenant -> lane (hash). ARGV[1]: the tenant, [2]: the number of lanes.
local lanes = tonumber(ARGV[2])
local have = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '')
if have and have < lanes then return have end
local count = {}
for i = 0, lanes - 1 do count[i] = 0 end
count[0] = 1  -- the default tenant's
for _, lane in ipairs(redis.call('HVALS', KEYS[1])) do
  local n = tonumber(lane)
  if n and n < lanes then count[n] = count[n] + 1 end
end
local best = 1 % lanes
for i = 0, lanes - 1 do
  if count[i] < count[best] then best = i end
end
redis.call('HSET', KEYS[1], ARGV[1], best)
return best
