-- The end of an agent's turn, in one call: log its last text chunks (unless the job has
-- ended), append its messages to the conversation, log its events, write the job's fields,
-- then close the turn's plan. KEYS[17]: the conversation.
-- ARGV[3]: JSON object of job fields, [4]: the owner (host:pid) that waits in place for the
-- job to drain ('' if none), [5]: the turn's fence, [6]: n, [7 .. 6+n]: the messages (JSON),
-- [7+n]: m, then m arguments of kind, data pairs of chunks, then kind, data pairs of events.
-- Returns 1 if the job drained (nothing left to wait for: its next turn is due), else 0; a
-- job that did not drain records its waiter (`turn_waiter`: job_drained tells it). Nothing is
-- written once the job record is gone, or (-1) by a turn whose fence is stale; the turn's
-- events are not logged once the job has ended.
if redis.call('EXISTS', K_JOB) == 0 then return 0 end
if stale_turn(ARGV[5], 'turn_end') then return -1 end
local n = tonumber(ARGV[6])
local m = tonumber(ARGV[7 + n])
local ended = job_ended()
if not ended then
  for i = 8 + n, 7 + n + m, 2 do emit(ARGV[i], ARGV[i + 1]) end
end
if n > 0 then
  redis.call('RPUSH', KEYS[17], unpack(ARGV, 7, 6 + n))
  redis.call('EXPIRE', KEYS[17], tonumber(redis.call('HGET', K_JOB, 'ttl') or '604800'))
end
if not ended then
  for i = 8 + n + m, #ARGV, 2 do emit(ARGV[i], ARGV[i + 1]) end
end
set_fields(ARGV[3])
redis.call('DEL', K_PARTIAL)  -- the turn's whole answer is in the conversation now
redis.call('HDEL', K_JOB, 'turn_waiter')
if job_ended() then return 0 end
redis.call('HSET', K_JOB, 'closed', '1')
local drained = job_drained(true)
if drained == 0 and ARGV[4] ~= '' then redis.call('HSET', K_JOB, 'turn_waiter', ARGV[4]) end
return drained
