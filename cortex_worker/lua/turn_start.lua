-- The start of an agent's turn, in one call: log the last turn's close, write the job's
-- fields, log the turn's start (only while the job has not ended), and read what its prompt
-- needs. KEYS[17]: the conversation, KEYS[18]: the run-time feed changes.
-- ARGV[3]: JSON object of job fields, [4]: JSON list of action ids whose results to read, or
-- null to read nothing (the job ends instead), [5]: how many of the kind, data pairs from
-- ARGV[6] on close the last turn (the rest begin this one).
-- Returns {seq of the last begin event (0: the job had ended, none logged; -1: none asked),
-- then, unless ARGV[4] is null: results (one per id, nil if unrecorded), feed changes (field,
-- value, ...), conversation}.
local ids = cjson.decode(ARGV[4])
local closing = 5 + tonumber(ARGV[5])
for i = 6, closing, 2 do emit(ARGV[i], ARGV[i + 1]) end
if redis.call('EXISTS', K_JOB) == 1 then set_fields(ARGV[3]) end
local begun = -1
if #ARGV > closing then
  begun = 0
  if not job_ended() then
    for i = closing + 1, #ARGV, 2 do begun = emit(ARGV[i], ARGV[i + 1]) end
  end
end
if ids == cjson.null then return {begun} end
local results = {}
if #ids > 0 then results = redis.call('HMGET', K_RESULT, unpack(ids)) end
return {begun, results, redis.call('HGETALL', KEYS[18]), redis.call('LRANGE', KEYS[17], 0, -1)}
