-- Send an action again that its worker lost (see reconciler.py). KEYS[17]: the job's redrives
-- hash. ARGV[3]: id, [4]: the lease owner found dead ('' : the action is queued and unclaimed),
-- [5]: why (for the warning), [6]: how many times it may be sent again.
-- Returns {'send', spec}, {'give_up', times}, or {} when nothing is to be done (it ended, or
-- someone claimed it meanwhile).
local id, dead, why, most = ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6])
if job_ended() or redis.call('HEXISTS', K_RESULT, id) == 1 then return {} end
local st = redis.call('HGET', K_STATUS, id)
local lease = redis.call('HGET', K_LEASE, id)
if dead ~= '' then
  if st ~= 'running' or not lease or string.match(lease, '^(.*)|[^|]*$') ~= dead then return {} end
elseif st ~= 'queued' or lease then
  return {}
end
local times = redis.call('HINCRBY', KEYS[17], id, 1)
redis.call('EXPIRE', KEYS[17], tonumber(redis.call('HGET', K_JOB, 'ttl') or '604800'))
if times > most then return {'give_up', times} end
redis.call('HDEL', K_LEASE, id)
redis.call('HSET', K_STATUS, id, 'queued')
redis.call('HSET', K_TM, 'q|' .. id, NOW)
emit('warning', cjson.encode({kind = 'action_redriven', action_id = id, times = times, message = why}))
return {'send', redis.call('HGET', K_SPEC, id)}
