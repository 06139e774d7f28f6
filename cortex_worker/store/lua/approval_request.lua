-- Hold a ready action for a person's approval instead of sending it. KEYS[17]: the job's
-- approvals hash. ARGV[3]: action id, [4]: the request record (JSON, state "requested"),
-- [5]: the data of its `approval_requested` event.
-- Returns 'new' when the request was made now, else the action's state: the approval's
-- ('requested', 'approved', 'rejected'), 'done' (it has a result) or 'ended' (the job).
local K_APPROVALS, id = KEYS[17], ARGV[3]
if job_ended() then return 'ended' end
local cur = redis.call('HGET', K_APPROVALS, id)
if cur then return cjson.decode(cur)['state'] end
if redis.call('HEXISTS', K_RESULT, id) == 1 then return 'done' end
redis.call('HSET', K_APPROVALS, id, ARGV[4])
redis.call('EXPIRE', K_APPROVALS, tonumber(redis.call('HGET', K_JOB, 'ttl') or '604800'))
redis.call('HSET', K_STATUS, id, 'awaiting_approval')
redis.call('HDEL', K_TM, 'q|' .. id)  -- not queued: the reconciler leaves it alone
emit('approval_requested', ARGV[5])
return 'new'
