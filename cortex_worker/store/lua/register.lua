-- ARGV[3]: JSON list of {id, spec, deps, after, on_error, awaited}; ARGV[4]: '1' closes the
-- plan (of the job, or of an agent's turn), [5]: the registering turn's fence ('' : none).
-- Returns the ids to dispatch now, then '|', then 1 if the job drained; or {'ended'} if the
-- job has ended (cancelled, failed, completed), {'stale'} if the turn's fence is: then
-- nothing is registered.
if job_ended() then return {'ended'} end
if stale_turn(ARGV[5], 'register') then return {'stale'} end
local out = {}
for _, a in ipairs(cjson.decode(ARGV[3])) do
  local id = a.id
  if redis.call('HSETNX', K_SPEC, id, a.spec) == 1 then
    redis.call('HSET', K_ONERR, id, a.on_error)
    redis.call('HSET', K_STATUS, id, 'pending')
    m_registered(id, a.spec)
    if a.awaited ~= false then
      redis.call('HSET', K_AWAIT, id, '1')
      redis.call('HINCRBY', K_JOB, 'remaining', 1)
    end
    local pending = 0
    for _, pair in ipairs({{'d', a.deps}, {'a', a.after}}) do
      for _, dep in ipairs(pair[2]) do
        local st = redis.call('HGET', K_STATUS, dep)
        if st and TERMINAL[st] then
          if pair[1] == 'd' and st ~= 'ok' and not redis.call('HGET', K_POISON, id) then
            redis.call('HSET', K_POISON, id, dep)
          end
        else
          local cur = redis.call('HGET', K_DEPS, dep)
          redis.call('HSET', K_DEPS, dep, (cur and (cur .. '\n') or '') .. pair[1] .. id)
          pending = pending + 1
        end
      end
    end
    redis.call('HSET', K_PENDING, id, pending)
    if pending == 0 and not a.hold then  -- `hold`: refused; its caller records the error
      local bad = redis.call('HGET', K_POISON, id)
      if bad and a.on_error ~= 'continue' then
        local why = 'dependency ' .. bad .. ' did not succeed'
        settle(id, 'skipped', skip_record(why), cjson.encode({error = why, status = 'skipped'}), nil,
               {'action_skipped', '{"action_id":' .. enc_id(id) .. ',"reason":' .. cjson.encode(why) .. '}'}, out)
      else
        make_ready(id, out)
      end
    end
  end
end
if ARGV[4] == '1' then redis.call('HSET', K_JOB, 'closed', '1') end
table.insert(out, '|')
table.insert(out, job_drained(ARGV[4] == '1'))
return out
