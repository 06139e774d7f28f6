-- The end of an agent's turn, in one call: append its messages to the conversation, log its
-- events, write the job's fields, then close the turn's plan. KEYS[17]: the conversation.
-- ARGV[3]: JSON object of job fields, [4]: n, [5 .. 4+n]: the messages (JSON), then kind,
-- data pairs of events.
-- Returns 1 if the job drained (nothing left to wait for: its next turn is due), else 0;
-- nothing is written once the job record is gone.
if redis.call('EXISTS', K_JOB) == 0 then return 0 end
local n = tonumber(ARGV[4])
if n > 0 then
  redis.call('RPUSH', KEYS[17], unpack(ARGV, 5, 4 + n))
  redis.call('EXPIRE', KEYS[17], tonumber(redis.call('HGET', K_JOB, 'ttl') or '604800'))
end
for i = 5 + n, #ARGV, 2 do emit(ARGV[i], ARGV[i + 1]) end
set_fields(ARGV[3])
if job_ended() then return 0 end
redis.call('HSET', K_JOB, 'closed', '1')
return job_drained()
