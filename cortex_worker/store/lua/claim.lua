-- ARGV[3]: action id, [4]: lease owner, [5]: lease seconds, [6]: '1' to take over a lease,
-- [7..]: variable names to read. Returns {'run', attempt, values...} or {'done'|'stop'|'busy'|'blocked', ...}.
local id = ARGV[3]
-- A job that ended in failure or was cancelled runs nothing more; a completed one still runs
-- its fire-and-forget actions.
local job_status = redis.call('HGET', K_JOB, 'status')
if not job_status or job_status == 'failed' or job_status == 'cancelled' then return {'stop'} end
if redis.call('HEXISTS', K_RESULT, id) == 1 then return {'done'} end
-- A lease not run out is held, by another worker or by another thread of this one (two
-- deliveries can reach one process): only a holder known dead is overtaken ('1').
local lease = redis.call('HGET', K_LEASE, id)
if lease and ARGV[6] ~= '1' then
  local owner, expiry = string.match(lease, '^(.*)|([^|]*)$')
  if tonumber(expiry) > tonumber(NOW) then return {'busy', owner, expiry} end
end
if tonumber(redis.call('HGET', K_PENDING, id) or '0') > 0 then return {'blocked'} end
redis.call('HSET', K_LEASE, id, ARGV[4] .. '|' .. (tonumber(NOW) + tonumber(ARGV[5])))
redis.call('HSET', K_STATUS, id, 'running')
redis.call('HDEL', K_TM, 'w|' .. id, 'm|' .. id)  -- it no longer waits for a slot or its model
local attempt = redis.call('HINCRBY', K_ATTEMPTS, id, 1)
m_started(id)
emit('action_started', '{"action_id":' .. enc_id(id) .. ',"attempt":' .. attempt ..
     ',"worker":' .. cjson.encode(ARGV[4]) .. '}')
local out = {'run', attempt}
for i = 7, #ARGV do
  table.insert(out, redis.call('HGET', K_VARS, ARGV[i]) or false)
end
return out
