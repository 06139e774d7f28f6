-- ARGV[3]: id, [4]: event data. The action goes back to the queue, keeping its slot.
local id = ARGV[3]
local job_status = redis.call('HGET', K_JOB, 'status')
if job_status == 'failed' or job_status == 'cancelled' or redis.call('HEXISTS', K_RESULT, id) == 1 then
  return 0
end
redis.call('HDEL', K_LEASE, id)
redis.call('HSET', K_STATUS, id, 'queued')
emit('action_retrying', ARGV[4])
return 1
