-- ARGV[3]: id, [4]: status, [5]: record, [6]: value, [7]: output_key, [8]: event kind, [9]: event
-- data, [10]: the attempt that ends ('' : not a claimed attempt: a refusal, a child job's end,
-- the reconciler giving up), [11]: its holder, [12]: the fence of the turn that records it (''),
-- [13]: the ids of the dependents whose messages were sent ahead of this finish, '\n'-separated.
-- Returns {recorded, drained, spec of each action to dispatch...}, or {'stale'} (nothing
-- recorded) if the attempt or the turn is no longer current. An action sent ahead is not
-- dispatched again, unless its message came before this finish (claim.lua's mark `e|<id>`).
if stale_attempt(ARGV[3], ARGV[10], ARGV[11], 'result') or stale_turn(ARGV[12], 'result') then
  return {'stale'}
end
local out = {}
if not settle(ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], {ARGV[8], ARGV[9]}, out) then
  return {0, 0}
end
local ahead = {}
for sent in string.gmatch(ARGV[13] or '', '[^\n]+') do ahead[sent] = true end
local result = {1, job_drained(false)}
for _, id in ipairs(out) do
  if not ahead[id] or redis.call('HDEL', K_TM, 'e|' .. id) == 1 then
    table.insert(result, redis.call('HGET', K_SPEC, id))
  end
end
return result
