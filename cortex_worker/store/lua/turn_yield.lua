-- A turn hands itself back before its stream opens: its model endpoint has no slot for longer
-- than a worker thread is held (llm/limits.py, ModelBusy). ARGV[3]: its owner, [4]: its fence. The turn's
-- lease ends now and its phase says so: the turn task sent for when a slot is due takes it
-- over (resume.lua) and generates it from the same inputs, without a restart's warning.
-- Returns 1 if it was the caller's turn to hand back, else 0.
if redis.call('HGET', K_JOB, 'status') ~= 'running' or redis.call('HGET', K_JOB, 'closed') ~= '0'
    or stale_turn(ARGV[4], 'turn_yield') or redis.call('HGET', K_JOB, 'turn_owner') ~= ARGV[3] then
  return 0
end
redis.call('HSET', K_JOB, 'turn_lease', NOW, 'turn_phase', 'yielded')
return 1
