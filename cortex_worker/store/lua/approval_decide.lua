-- Answer an approval request, once. KEYS[17]: the job's approvals hash. ARGV[3]: action id,
-- [4]: 'approved' or 'rejected', [5]: the data of the `action_<decision>` event (JSON:
-- action_id, by, reason).
-- Returns ARGV[4] when this call decided, else what stood in the way: an earlier answer
-- ('was_approved', 'was_rejected'), 'none' (nothing was requested) or 'ended' (the job).
local K_APPROVALS, id, decision = KEYS[17], ARGV[3], ARGV[4]
if job_ended() then return 'ended' end
local cur = redis.call('HGET', K_APPROVALS, id)
if not cur then return 'none' end
local rec = cjson.decode(cur)
if rec['state'] ~= 'requested' then return 'was_' .. rec['state'] end
local data = cjson.decode(ARGV[5])
rec['state'], rec['decided_at'], rec['by'], rec['reason'] = decision, tonumber(NOW), data['by'], data['reason']
redis.call('HSET', K_APPROVALS, id, cjson.encode(rec))
if decision == 'approved' then
  redis.call('HSET', K_STATUS, id, 'queued')
  redis.call('HSET', K_TM, 'q|' .. id, NOW)  -- queued from now: a lost message is sent again
end
emit('action_' .. decision, ARGV[5])
return decision
