-- Start a job whose plan is known (a document, a workflow): queued -> running, and log
-- ARGV[3..] (kind, data, ...). Returns 'started', 'running' (a redelivered start: it began
-- before), or 'ended' (cancelled, or gone, before it began: nothing is logged).
local st = redis.call('HGET', K_JOB, 'status')
if st == 'running' then return 'running' end
if st ~= 'queued' then return 'ended' end
redis.call('HSET', K_JOB, 'status', 'running', 'started_at', NOW)
for i = 3, #ARGV, 2 do emit(ARGV[i], ARGV[i + 1]) end
return 'started'
