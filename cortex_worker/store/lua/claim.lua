-- ARGV[3]: action id, [4]: lease owner, [5]: lease seconds, [6]: '1' to take over a lease,
-- [7]: '1' if its message was sent ahead of its dependencies' finish (`ahead`), [8]: how many
-- dependents to foresee, [9..]: variable names to read.
-- Returns {'run', attempt, values..., foreseen specs...} or {'done'|'stop'|'busy'|'blocked', ...}.
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
local status = redis.call('HGET', K_STATUS, id)
if tonumber(redis.call('HGET', K_PENDING, id) or '0') > 0
   or (ARGV[7] == '1' and (status == 'pending' or status == 'waiting')) then
  -- Not ready (yet). A message sent ahead came before the finish that makes the action ready
  -- (or that finish parked it): it is dropped, and its mark has that finish send it again.
  if ARGV[7] == '1' then redis.call('HSET', K_TM, 'e|' .. id, NOW) end
  return {'blocked'}
end
redis.call('HSET', K_LEASE, id, ARGV[4] .. '|' .. (tonumber(NOW) + tonumber(ARGV[5])))
redis.call('HSET', K_STATUS, id, 'running')
-- it no longer waits for a slot or its model, or for a finish to send it again
redis.call('HDEL', K_TM, 'w|' .. id, 'm|' .. id, 'e|' .. id)
local attempt = redis.call('HINCRBY', K_ATTEMPTS, id, 1)
m_started(id)
emit('action_started', '{"action_id":' .. enc_id(id) .. ',"attempt":' .. attempt ..
     ',"worker":' .. cjson.encode(ARGV[4]) .. '}')
local out = {'run', attempt}
for i = 9, #ARGV do
  table.insert(out, redis.call('HGET', K_VARS, ARGV[i]) or false)
end
-- Foresee: the dependents this action's success alone will make ready (every other dependency
-- has ended, none poisons them) and the job's parallelism has room for. Their messages can go
-- out ahead of this action's finish (executor.py: `_ahead`).
local room = math.min(tonumber(ARGV[8]),
  tonumber(redis.call('HGET', K_JOB, 'limit') or '1000000')
  - tonumber(redis.call('HGET', K_JOB, 'running') or '0') + 1)
-- At most 8 times as many dependents as asked for are looked at: an action with a thousand
-- dependents that wait for others too is not walked at each claim (its finish walks them).
local looks = 8 * tonumber(ARGV[8])
local deps = room > 0 and redis.call('HGET', K_DEPS, id)
if deps then
  for edge in string.gmatch(deps, '[^\n]+') do
    if room <= 0 or looks <= 0 then break end
    looks = looks - 1
    local d = string.sub(edge, 2)
    if redis.call('HGET', K_PENDING, d) == '1' and redis.call('HGET', K_STATUS, d) == 'pending'
       and not (redis.call('HGET', K_POISON, d) and redis.call('HGET', K_ONERR, d) ~= 'continue') then
      local spec = redis.call('HGET', K_SPEC, d)
      if spec then
        table.insert(out, spec)
        room = room - 1
      end
    end
  end
end
return out
