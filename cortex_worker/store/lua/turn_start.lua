-- The start of an agent's turn, in one call (see begin_turn in the prelude).
-- ARGV[3]: JSON object of job fields, [4]: JSON list of action ids whose results to read, or
-- null to read nothing (the job ends instead), [5]: the turn's fence, [6]: how many of the
-- kind, data pairs from ARGV[7] on close the last turn (the rest begin this one).
-- Returns {'stale'} (nothing written) if the fence is no longer the turn's.
if stale_turn(ARGV[5], 'turn_start') then return {'stale'} end
return begin_turn(ARGV[3], cjson.decode(ARGV[4]), 6)
