-- End the job. ARGV[3]: final status, [4]: JSON object of job fields, [5]: only_if ('' or a
-- status the job must have), [6..]: events (kind, data). Unless the job completed, unfinished
-- actions become cancelled.
-- Returns the ids of actions that were queued or running, or false if the job had ended.
local cur = redis.call('HGET', K_JOB, 'status')
if JOB_TERMINAL[cur] then return false end
if ARGV[5] ~= '' and cur ~= ARGV[5] then return false end
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
for i = 6, #ARGV, 2 do emit(ARGV[i], ARGV[i + 1]) end
expire_all()
redis.call('SREM', ACTIVE_JOBS, JOB)
redis.call('PUBLISH', ENDED_CHANNEL, JOB)
return live
