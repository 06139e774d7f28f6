-- Start an agent's next turn: queued|finishing -> running, reopen the plan, take the inbox.
-- ARGV[3]: the new turn owner (host:pid, '' if unknown), [4]: its lease in seconds, [5]: the
-- current owner the caller found dead ('' if none).
-- A turn in progress (running, plan open) is taken over, not begun again, when its owner is
-- ARGV[5] (a dead process) or its lease has expired: the same turn number and the same inbox
-- (kept in `turn_inbox`) are returned, so the new owner can generate the turn again.
-- ARGV[6]: the turn to begin at once ('' if none), [7]: JSON object of job fields, [8] and on:
-- the turn's close and begin events as turn_start.lua takes them. A caller that knows how the
-- last turn closes (nothing to render: no pending responses, no final response) sends them,
-- and the turn begins in this call if it is that turn, begun now (not taken over), and the
-- record agrees; turn 1 also logs `job_started` (kind agent, the record's agent) first.
-- KEYS[17], KEYS[18]: the conversation and the feed changes.
-- Each grant takes the next turn fence (`turn_fence`, in the record returned): the turn's
-- writes carry it (fencing, in the prelude).
-- Returns {turn, restarted (0|1), n, the n ids finished before the turn, m, the job record
-- (m values: field, value, ...), then what begin_turn returned, or 0 if the turn was not
-- begun}, or {0} if no turn is due.

-- `out` with the ids and the job record after it: the caller needs both to start the turn.
local function with_record(out, ids)
  table.insert(out, #ids)
  for _, id in ipairs(ids) do table.insert(out, id) end
  local record = redis.call('HGETALL', K_JOB)
  table.insert(out, #record)
  for _, x in ipairs(record) do table.insert(out, x) end
  return out
end

-- Begin the turn now, if the caller asked for `turn` and nothing needs rendering first.
local function begin_now(out, turn, ids)
  local pending = redis.call('HGET', K_JOB, 'pending_responses')
  if (ARGV[6] or '') == '' or tonumber(ARGV[6]) ~= turn or (pending and pending ~= '[]' and
      pending ~= '') or redis.call('HGET', K_JOB, 'final') == '1' then
    table.insert(out, 0)
    return out
  end
  local want = {}
  for _, call in ipairs(cjson.decode(redis.call('HGET', K_JOB, 'native_calls') or '[]')) do
    table.insert(want, call.action_id)
  end
  for _, id in ipairs(ids) do table.insert(want, id) end
  local started = nil
  if turn == 1 then
    started = '{"kind":"agent","agent":' .. cjson.encode(redis.call('HGET', K_JOB, 'agent') or '') .. '}'
  end
  table.insert(out, begin_turn(ARGV[7], want, 8, started))
  return out
end

local owner, lease, dead = ARGV[3] or '', tonumber(ARGV[4] or '30'), ARGV[5] or ''
local st = redis.call('HGET', K_JOB, 'status')
if st == 'running' and redis.call('HGET', K_JOB, 'closed') == '0' then
  local cur = redis.call('HGET', K_JOB, 'turn_owner')
  if not cur or owner == '' then return {0} end
  local expiry = tonumber(redis.call('HGET', K_JOB, 'turn_lease') or '0')
  if not (dead ~= '' and cur == dead) and expiry > tonumber(NOW) then return {0} end
  redis.call('HSET', K_JOB, 'turn_owner', owner, 'turn_lease', tostring(tonumber(NOW) + lease),
             'turn_taken_from', cur)
  redis.call('HINCRBY', K_JOB, 'turn_fence', 1)  -- the holder it took over from is stale now
  local out = with_record({tonumber(redis.call('HGET', K_JOB, 'turn') or '1'), 1},
                          cjson.decode(redis.call('HGET', K_JOB, 'turn_inbox') or '[]'))
  table.insert(out, 0)  -- a turn taken over is generated again by its own path
  return out
end
if st ~= 'queued' and st ~= 'finishing' then return {0} end
redis.call('HSET', K_JOB, 'status', 'running', 'closed', '0')
if st == 'queued' then redis.call('HSET', K_JOB, 'started_at', NOW) end
local turn = redis.call('HINCRBY', K_JOB, 'turn', 1)
local out = {turn, 0}
local ids = redis.call('LRANGE', K_INBOX, 0, -1)
redis.call('DEL', K_INBOX)
redis.call('HINCRBY', K_JOB, 'turn_fence', 1)
redis.call('DEL', K_PARTIAL)  -- a new turn: nothing streamed yet (a takeover keeps it)
if owner ~= '' then
  redis.call('HSET', K_JOB, 'turn_owner', owner, 'turn_lease', tostring(tonumber(NOW) + lease),
             'turn_phase', 'resumed', 'turn_inbox', #ids > 0 and cjson.encode(ids) or '[]')
end
return begin_now(with_record(out, ids), turn, ids)
