-- Admit a job among its tenant's running jobs (jobs/tenants.py). No prelude. KEYS[1]: the
-- tenant's admitted jobs (set). ARGV[1]: the job, [2]: the tenant's max_running_jobs.
-- Returns 1 if it is admitted (now, or before), 0 if the tenant is at its cap.
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return 1 end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('SADD', KEYS[1], ARGV[1])
return 1
