-- A streaming turn renews its lease. ARGV[3]: its fence, [4]: the lease's new end.
-- Returns 1, or 0 if the job has ended or the turn is no longer this fence's (taken over).
if job_ended() or stale_turn(ARGV[3], 'turn_renew') then return 0 end
redis.call('HSET', K_JOB, 'turn_lease', ARGV[4])
return 1
