-- Cortex job state scripts. Every script is loaded with this prelude; KEYS are the job's keys
-- (see keys.py: JobKeys), ARGV[1] is the job id, ARGV[2] the clock (seconds, float), then
-- `|` and the write's id (see `once`, at the end; '' or absent: not remembered).
-- All of a job's keys share the hash tag {job_id}, so a job lives on one Redis shard.

local K_JOB, K_SPEC, K_STATUS, K_RESULT, K_PENDING, K_POISON, K_DEPS, K_VARS, K_LEASE,
      K_WAIT, K_SEQ, K_EVENTS, K_ONERR, K_ATTEMPTS, K_AWAIT, K_INBOX = unpack(KEYS, 1, 16)
local JOB = ARGV[1]
local NOW, WRITE = string.match(ARGV[2], '^([^|]*)|?(.*)$')
local TERMINAL = {ok = true, error = true, timeout = true, skipped = true, cancelled = true}
local JOB_TERMINAL = {completed = true, failed = true, cancelled = true}
local JOB_END_EVENTS = {job_completed = true, job_failed = true, job_cancelled = true}
local ENDED_CHANNEL = 'cx:ended'  -- keys.ENDED_CHANNEL: the id of every job that ends
local ACTIVE_JOBS = 'cx:active'  -- keys.ACTIVE_JOBS: jobs that have not ended

-- Set fields of the job record from a JSON object of strings (as record.encode makes them).
local function set_fields(json)
  for k, v in pairs(cjson.decode(json)) do redis.call('HSET', K_JOB, k, v) end
end

-- Whether the job is gone or has ended: nothing new may be registered, started or logged for it.
local function job_ended()
  local st = redis.call('HGET', K_JOB, 'status')
  return not st or JOB_TERMINAL[st] == true
end

-- Append one event: seq, stream entry and publish, atomically (the only writer of the log).
local function emit(kind, data)
  local seq = redis.call('INCR', K_SEQ)
  local ev = '{"job_id":' .. cjson.encode(JOB) .. ',"seq":' .. seq .. ',"ts":' .. NOW ..
             ',"type":"' .. kind .. '","data":' .. data .. '}'
  redis.call('XADD', K_EVENTS, seq .. '-0', 'e', ev)
  redis.call('PUBLISH', 'cx:ev:' .. JOB, ev)
  if redis.call('EXISTS', K_JOB) == 1 then redis.call('HSET', K_JOB, 'progress_at', NOW) end
  if seq == 1 then
    local ttl = tonumber(redis.call('HGET', K_JOB, 'ttl') or '604800')
    redis.call('EXPIRE', K_SEQ, ttl)
    redis.call('EXPIRE', K_EVENTS, ttl)
  end
  return seq
end

local function enc_id(id) return cjson.encode(id) end

-- Metrics (docs/runtime.md#metrics; read by cortex_worker/metrics.py at scrape time): global
-- counters and histograms in cx:metrics*, and each action's type, queued and started times in
-- the job's `tm` hash, dropped when it ends. A histogram field is `<labels>|<le>` (one count
-- per bucket, not cumulative) or `<labels>|sum`.
local M_COUNTERS, M_DISPATCH, M_DURATION = 'cx:metrics', 'cx:metrics:hist:dispatch',
                                           'cx:metrics:hist:duration'
local K_TM = 'cx:{' .. JOB .. '}:tm'
local K_PARTIAL = 'cx:{' .. JOB .. '}:partial'  -- keys.JobKeys.partial
-- Fencing (recovery/fencing.py). Every lease carries a number that only grows: a turn's
-- `turn_fence` in the job record (resume.lua takes the next one as it grants a turn), an
-- action's attempt (claim.lua). Its holder passes its number with each write; a write whose
-- number is no longer current (its holder was paused and its lease taken over) is refused
-- here, in the same call, and counted (metric stale_writes|<write>). '' : no fence.
local function stale_turn(fence, write)
  if fence == nil or fence == '' or redis.call('HGET', K_JOB, 'turn_fence') == fence then
    return false
  end
  redis.call('HINCRBY', M_COUNTERS, 'stale_writes|' .. write, 1)
  return true
end

-- An action's attempt is current while it is the last claimed and its holder keeps the lease
-- (the reconciler releases the lease of a holder it found dead before it sends it again).
local function stale_attempt(id, attempt, holder, write)
  if attempt == nil or attempt == '' then return false end
  local lease = redis.call('HGET', K_LEASE, id)
  if redis.call('HGET', K_ATTEMPTS, id) == attempt and lease and
     string.match(lease, '^(.*)|[^|]*$') == holder then
    return false
  end
  redis.call('HINCRBY', M_COUNTERS, 'stale_writes|' .. write, 1)
  return true
end

local M_BUCKETS = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300}

local function m_observe(key, labels, seconds)
  if seconds < 0 then seconds = 0 end
  local le = '+Inf'
  for _, b in ipairs(M_BUCKETS) do
    if seconds <= b then le = tostring(b) break end
  end
  redis.call('HINCRBY', key, labels .. '|' .. le, 1)
  redis.call('HINCRBYFLOAT', key, labels .. '|sum', seconds)
end

-- register: remember the action's type (the first "type" of its spec JSON).
local function m_registered(id, spec)
  redis.call('HSET', K_TM, 't|' .. id, string.match(spec, '"type":%s*"(%w+)"') or 'unknown')
  redis.call('EXPIRE', K_TM, tonumber(redis.call('HGET', K_JOB, 'ttl') or '604800'))
end

-- claim: observe the dispatch latency of the first claim after it was queued.
local function m_started(id)
  local f = redis.call('HMGET', K_TM, 't|' .. id, 'q|' .. id)
  if f[2] then
    m_observe(M_DISPATCH, f[1] or 'unknown', tonumber(NOW) - tonumber(f[2]))
    redis.call('HDEL', K_TM, 'q|' .. id)
  end
  redis.call('HSET', K_TM, 's|' .. id, NOW)
end

-- settle (and skips): count the end, observe the duration since the last claim.
local function m_ended(id, status)
  local f = redis.call('HMGET', K_TM, 't|' .. id, 's|' .. id)
  local t = f[1] or 'unknown'
  redis.call('HINCRBY', M_COUNTERS, 'actions_ended|' .. t .. '|' .. status, 1)
  if f[2] then m_observe(M_DURATION, t .. '|' .. status, tonumber(NOW) - tonumber(f[2])) end
  redis.call('HDEL', K_TM, 't|' .. id, 's|' .. id, 'q|' .. id, 'e|' .. id)
end

-- close, before it cancels: count the job's end and the actions it is about to cancel.
local function m_job_ended(status)
  redis.call('HINCRBY', M_COUNTERS, 'jobs_ended|' .. status, 1)
  if status == 'completed' then return end
  local statuses = redis.call('HGETALL', K_STATUS)
  for i = 1, #statuses, 2 do
    if not TERMINAL[statuses[i + 1]] then m_ended(statuses[i], 'cancelled') end
  end
end

-- Queue `id` if a parallelism slot is free, else park it on the wait list.
local function make_ready(id, out)
  local limit = tonumber(redis.call('HGET', K_JOB, 'limit') or '1000000')
  local running = tonumber(redis.call('HGET', K_JOB, 'running') or '0')
  if running < limit then
    redis.call('HINCRBY', K_JOB, 'running', 1)
    redis.call('HSET', K_STATUS, id, 'queued')
    redis.call('HSET', K_TM, 'q|' .. id, NOW)
    emit('action_queued', '{"action_id":' .. enc_id(id) .. '}')
    table.insert(out, id)
  else
    redis.call('HSET', K_STATUS, id, 'waiting')
    redis.call('RPUSH', K_WAIT, id)
  end
end

-- Record a terminal state once; walk dependents (skipping poisoned ones), free slots.
-- Returns the ids to dispatch and whether the job has nothing left to run.
local function settle(id, status, record, value, output_key, event, out)
  if redis.call('HSETNX', K_RESULT, id, record) == 0 then return false end
  local before = redis.call('HGET', K_STATUS, id)
  redis.call('HSET', K_STATUS, id, status)
  redis.call('HDEL', K_LEASE, id)
  redis.call('HSET', K_VARS, id, value)
  if output_key and output_key ~= '' then redis.call('HSET', K_VARS, output_key, value) end
  emit(event[1], event[2])
  m_ended(id, status)
  if before == 'queued' or before == 'running' then redis.call('HINCRBY', K_JOB, 'running', -1) end
  if redis.call('HEXISTS', K_AWAIT, id) == 1 then
    redis.call('HINCRBY', K_JOB, 'remaining', -1)
    redis.call('RPUSH', K_INBOX, id)
  end
  if status ~= 'ok' and status ~= 'skipped' and status ~= 'cancelled' then
    redis.call('HINCRBY', K_JOB, 'failures', 1)
  end
  local queue = {{id, status}}
  while #queue > 0 do
    local item = table.remove(queue, 1)
    local src, src_status = item[1], item[2]
    local deps = redis.call('HGET', K_DEPS, src)
    if deps then
      for edge in string.gmatch(deps, '[^\n]+') do
        local kind, d = string.sub(edge, 1, 1), string.sub(edge, 2)
        if kind == 'd' and src_status ~= 'ok' and not redis.call('HGET', K_POISON, d) then
          redis.call('HSET', K_POISON, d, src)
        end
        if redis.call('HINCRBY', K_PENDING, d, -1) == 0 and redis.call('HGET', K_SPEC, d) then
          local bad = redis.call('HGET', K_POISON, d)
          if bad and redis.call('HGET', K_ONERR, d) ~= 'continue' then
            local why = 'dependency ' .. bad .. ' did not succeed'
            local err = cjson.encode({error = why, status = 'skipped'})
            local rec = '{"status":"skipped","error":' .. cjson.encode(why) .. ',"finished_at":' .. NOW .. '}'
            if redis.call('HSETNX', K_RESULT, d, rec) == 1 then
              redis.call('HSET', K_STATUS, d, 'skipped')
              redis.call('HSET', K_VARS, d, err)
              emit('action_skipped', '{"action_id":' .. enc_id(d) .. ',"reason":' .. cjson.encode(why) .. '}')
              m_ended(d, 'skipped')
              if redis.call('HEXISTS', K_AWAIT, d) == 1 then
                redis.call('HINCRBY', K_JOB, 'remaining', -1)
                redis.call('RPUSH', K_INBOX, d)
              end
              table.insert(queue, {d, 'skipped'})
            end
          else
            make_ready(d, out)
          end
        end
      end
    end
  end
  -- freed slots take parked actions
  local limit = tonumber(redis.call('HGET', K_JOB, 'limit') or '1000000')
  while tonumber(redis.call('HGET', K_JOB, 'running') or '0') < limit do
    local w = redis.call('LPOP', K_WAIT)
    if not w then break end
    if redis.call('HGET', K_STATUS, w) == 'waiting' then make_ready(w, out) end
  end
  return true
end

-- The job drained (its plan closed, nothing left to wait for): it becomes `finishing`, and the
-- caller must act on it (1), unless the agent turn waiting in place for it (`turn_waiter`,
-- host:pid) is told on its process's channel (keys.wake_channel): that turn takes the next one
-- itself (0). A waiter whose process no longer listens receives nothing (1). `own`: the caller
-- is the agent's coordinator, at its turn's end; it goes on itself. An agent job counts who
-- took its drain (metric agent_drains: in_place or queued, sent as a task by `on_drained`).
local function job_drained(own)
  if redis.call('HGET', K_JOB, 'closed') ~= '1' or
     tonumber(redis.call('HGET', K_JOB, 'remaining') or '0') > 0 or
     redis.call('HGET', K_JOB, 'status') ~= 'running' then
    return 0
  end
  redis.call('HSET', K_JOB, 'status', 'finishing')
  local waiter = redis.call('HGET', K_JOB, 'turn_waiter')
  if waiter then redis.call('HDEL', K_JOB, 'turn_waiter') end
  local woken = not own and waiter and redis.call('PUBLISH', 'cx:wake:' .. waiter, JOB) > 0
  if redis.call('HGET', K_JOB, 'kind') == 'agent' then
    redis.call('HINCRBY', M_COUNTERS, 'agent_drains|' .. ((own or woken) and 'in_place' or 'queued'), 1)
  end
  return woken and 0 or 1
end

-- Keep every key of the job for the retention period from now.
local function expire_all()
  local ttl = tonumber(redis.call('HGET', K_JOB, 'ttl') or '604800')
  for i = 1, #KEYS do redis.call('EXPIRE', KEYS[i], ttl) end
end

local function skip_record(why)
  return '{"status":"skipped","error":' .. cjson.encode(why) .. ',"finished_at":' .. NOW .. '}'
end

-- A turn's start (turn_start.lua; resume.lua when its caller knows how the last turn closes):
-- log the close (ARGV[at] arguments of kind, data pairs from ARGV[at + 1]), write `fields`,
-- log the turn's begin events (the pairs after those, only while the job has not ended), and
-- read what its prompt needs. KEYS[17]: the conversation, KEYS[18]: the run-time feed changes.
-- `ids`: the action ids whose results to read, or cjson.null to read nothing. `started`: the
-- data of a `job_started` event to log before the begin events (an agent's first turn).
-- Returns {seq of the last begin event (0: the job had ended, none logged; -1: none asked),
-- then, unless `ids` is null: results (one per id, nil if unrecorded), feed changes (field,
-- value, ...), conversation}.
local function begin_turn(fields, ids, at, started)
  local closing = at + tonumber(ARGV[at])
  for i = at + 1, closing, 2 do emit(ARGV[i], ARGV[i + 1]) end
  if redis.call('EXISTS', K_JOB) == 1 then set_fields(fields) end
  local begun = -1
  if #ARGV > closing then
    begun = 0
    if not job_ended() then
      if started then emit('job_started', started) end
      for i = closing + 1, #ARGV, 2 do begun = emit(ARGV[i], ARGV[i + 1]) end
    end
  end
  if ids == cjson.null then return {begun} end
  local results = {}
  if #ids > 0 then results = redis.call('HMGET', K_RESULT, unpack(ids)) end
  return {begun, results, redis.call('HGETALL', KEYS[18]), redis.call('LRANGE', KEYS[17], 0, -1)}
end

-- A write is applied once, however often it is sent: redis-py sends a command again when its
-- connection broke before the reply came (a network cut, a failover to a replica that has
-- the first run or not). The script's body runs as `body` (store/state.py wraps it), and its
-- reply is kept for `WRITE_MEMO_S` under the write's id; the same write sent again gets that
-- reply, and changes nothing.
local WRITE_MEMO_S = 300
local function once(body)
  if WRITE == nil or WRITE == '' then return body() end
  local memo = 'cx:{' .. JOB .. '}:w:' .. WRITE  -- keys.JobKeys: the job's hash tag
  local seen = redis.call('GET', memo)
  if seen then return cjson.decode(seen) end
  local reply = body()
  redis.call('SET', memo, cjson.encode(reply == nil and false or reply), 'EX', WRITE_MEMO_S)
  return reply
end
