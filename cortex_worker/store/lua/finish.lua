-- ARGV[3]: id, [4]: status, [5]: record, [6]: value, [7]: output_key, [8]: event kind, [9]: event data.
-- Returns {recorded, drained, spec of each action to dispatch...}.
local out = {}
if not settle(ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], {ARGV[8], ARGV[9]}, out) then
  return {0, 0}
end
local result = {1, job_drained(false)}
for _, id in ipairs(out) do table.insert(result, redis.call('HGET', K_SPEC, id)) end
return result
