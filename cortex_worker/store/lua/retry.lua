-- ARGV[3]: id, [4]: event data, [5]: the attempt that failed, [6]: its holder.
-- The action goes back to the queue, keeping its slot. Returns 1, 0 if it is not to run again
-- (its job ended, or it is recorded), or -1 if the attempt is stale (another runs it).
local id = ARGV[3]
local job_status = redis.call('HGET', K_JOB, 'status')
if job_status == 'failed' or job_status == 'cancelled' or redis.call('HEXISTS', K_RESULT, id) == 1 then
  return 0
end
if stale_attempt(id, ARGV[5], ARGV[6], 'retry') then return -1 end
redis.call('HDEL', K_LEASE, id)
redis.call('HSET', K_STATUS, id, 'queued')
emit('action_retrying', ARGV[4])
return 1
