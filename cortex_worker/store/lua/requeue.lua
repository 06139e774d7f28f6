-- ARGV[3]: id. Specs of its dependents that are queued (sent, maybe lost with a dead worker).
local out = {}
local deps = redis.call('HGET', K_DEPS, ARGV[3])
if deps then
  for edge in string.gmatch(deps, '[^\n]+') do
    local d = string.sub(edge, 2)
    if redis.call('HGET', K_STATUS, d) == 'queued' then table.insert(out, redis.call('HGET', K_SPEC, d)) end
  end
end
return out
