-- ARGV[3]: '1' to log only while the job has not ended (a turn's output), [4]: the turn's
-- fence ('' : none), [5]: text the turn's model streamed, to append to its partial answer
-- (keys.JobKeys.partial; '' : none), [6..]: kind, data, kind, data ... Returns the last seq,
-- 0 if nothing was logged (the job had ended), or -1 if the turn's fence is stale (nothing
-- was written).
if ARGV[3] == '1' and job_ended() then return 0 end
if stale_turn(ARGV[4], 'events') then return -1 end
if ARGV[5] ~= '' then
  redis.call('APPEND', K_PARTIAL, ARGV[5])
  redis.call('EXPIRE', K_PARTIAL, tonumber(redis.call('HGET', K_JOB, 'ttl') or '604800'))
end
local seq = 0
for i = 6, #ARGV, 2 do seq = emit(ARGV[i], ARGV[i + 1]) end
return seq
