-- End the job. ARGV[3]: final status, [4]: JSON object of job fields, [5]: only_if ('' or a
-- status the job must have), [6]: the fence of the turn that ends it ('' : not a turn),
-- [7..]: events (kind, data). Unless the job completed, unfinished actions become cancelled.
-- Returns the ids of actions that were queued or running, or false if the job had ended (or
-- the turn's fence is stale: a turn taken over does not end its job).
local cur = redis.call('HGET', K_JOB, 'status')
if JOB_TERMINAL[cur] then return false end
if ARGV[5] ~= '' and cur ~= ARGV[5] then return false end
if stale_turn(ARGV[6], 'job_end') then return false end
redis.call('HSET', K_JOB, 'status', ARGV[3], 'finished_at', NOW)
m_job_ended(ARGV[3])
set_fields(ARGV[4])
local live = {}
local statuses = redis.call('HGETALL', K_STATUS)
for i = 1, #statuses, 2 do
  local id, st = statuses[i], statuses[i + 1]
  if not TERMINAL[st] and ARGV[3] ~= 'completed' then  -- fire-and-forget actions still finish
    if st == 'queued' or st == 'running' then table.insert(live, id) end
    local rec = '{"status":"cancelled","error":"job ended: ' .. ARGV[3] .. '","finished_at":' .. NOW .. '}'
    redis.call('HSETNX', K_RESULT, id, rec)
    redis.call('HSET', K_STATUS, id, 'cancelled')
    emit('action_cancelled', '{"action_id":' .. enc_id(id) .. '}')
  end
end
redis.call('DEL', K_WAIT)
-- The end event (the last) carries what the job's model requests spent, by endpoint
-- (KEYS[17]: the job's usage hash, `<endpoint>|<count>` -> n; jobs/usage.py).
local function with_usage(data)
  local flat = redis.call('HGETALL', KEYS[17])
  if #flat == 0 then return data end
  local by = {}
  for i = 1, #flat, 2 do
    local cut = string.find(flat[i], '|[^|]*$')
    local endpoint, name = string.sub(flat[i], 1, cut - 1), string.sub(flat[i], cut + 1)
    by[endpoint] = by[endpoint] or {prompt_tokens = 0, completion_tokens = 0, requests = 0}
    by[endpoint][name] = tonumber(flat[i + 1])
  end
  local usage = '"usage":' .. cjson.encode(by)
  if string.match(data, '^%s*{%s*}%s*$') then return '{' .. usage .. '}' end
  return string.gsub(data, '}%s*$', ',' .. usage .. '}', 1)
end
for i = 7, #ARGV, 2 do
  local data = ARGV[i + 1]
  if i + 1 == #ARGV and JOB_END_EVENTS[ARGV[i]] then data = with_usage(data) end
  emit(ARGV[i], data)
end
expire_all()
redis.call('SREM', ACTIVE_JOBS, JOB)
redis.call('PUBLISH', ENDED_CHANNEL, JOB)
return live
