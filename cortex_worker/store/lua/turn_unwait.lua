-- A turn that waited in place for its job to drain stops waiting. ARGV[3]: its owner.
-- Returns 1 if the drain was handed to it meanwhile (its message may still be on the way: the
-- caller takes the next turn), 0 if not: it is no longer the waiter, and the drain, when it
-- comes, is acted on as any other (job_drained returns 1).
if redis.call('HGET', K_JOB, 'turn_waiter') == ARGV[3] then
  redis.call('HDEL', K_JOB, 'turn_waiter')
  return 0
end
return redis.call('HGET', K_JOB, 'status') == 'finishing' and 1 or 0
