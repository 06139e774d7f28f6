-- Take a slot of a cap on actions running at once (a tool's max_concurrency, a tenant's
-- max_actions_in_flight), or wait in line (see store.take_slot). No prelude: these are the
-- gate's keys, not a job's. KEYS[1]: slots (zset holder -> lease end),
-- KEYS[2]: waiting (list). ARGV[1]: holder, [2]: now, [3]: lease end, [4]: limit, [5]: the
-- waiting entry ('' : do not wait in line). Returns 1 if the slot was taken, 0 if not.
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])  -- slots of dead workers free up
if redis.call('ZSCORE', KEYS[1], ARGV[1]) or redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[4]) then
  redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
  return 1
end
if ARGV[5] ~= '' then redis.call('RPUSH', KEYS[2], ARGV[5]) end
return 0
