-- Start an agent's next turn: queued|finishing -> running, reopen the plan, take the inbox.
-- ARGV[3]: the new turn owner (host:pid, '' if unknown), [4]: its lease in seconds, [5]: the
-- current owner the caller found dead ('' if none).
-- A turn in progress (running, plan open) is taken over, not begun again, when its owner is
-- ARGV[5] (a dead process) or its lease has expired: the same turn number and the same inbox
-- (kept in `turn_inbox`) are returned, so the new owner can generate the turn again.
-- Returns {turn, restarted (0|1), n, the n ids finished before the turn, then the job record
-- (field, value, ...)}, or {0} if no turn is due.

-- `out` with the ids and the job record after it: the caller needs both to start the turn.
local function with_record(out, ids)
  table.insert(out, #ids)
  for _, id in ipairs(ids) do table.insert(out, id) end
  for _, x in ipairs(redis.call('HGETALL', K_JOB)) do table.insert(out, x) end
  return out
end

local owner, lease, dead = ARGV[3] or '', tonumber(ARGV[4] or '30'), ARGV[5] or ''
local st = redis.call('HGET', K_JOB, 'status')
if st == 'running' and redis.call('HGET', K_JOB, 'closed') == '0' then
  local cur = redis.call('HGET', K_JOB, 'turn_owner')
  if not cur or owner == '' then return {0} end
  local expiry = tonumber(redis.call('HGET', K_JOB, 'turn_lease') or '0')
  if not (dead ~= '' and cur == dead) and expiry > tonumber(NOW) then return {0} end
  redis.call('HSET', K_JOB, 'turn_owner', owner, 'turn_lease', tostring(tonumber(NOW) + lease))
  return with_record({tonumber(redis.call('HGET', K_JOB, 'turn') or '1'), 1},
                     cjson.decode(redis.call('HGET', K_JOB, 'turn_inbox') or '[]'))
end
if st ~= 'queued' and st ~= 'finishing' then return {0} end
redis.call('HSET', K_JOB, 'status', 'running', 'closed', '0')
if st == 'queued' then redis.call('HSET', K_JOB, 'started_at', NOW) end
local out = {redis.call('HINCRBY', K_JOB, 'turn', 1), 0}
local ids = redis.call('LRANGE', K_INBOX, 0, -1)
redis.call('DEL', K_INBOX)
if owner ~= '' then
  redis.call('HSET', K_JOB, 'turn_owner', owner, 'turn_lease', tostring(tonumber(NOW) + lease),
             'turn_phase', 'resumed', 'turn_inbox', #ids > 0 and cjson.encode(ids) or '[]')
end
return with_record(out, ids)
