-- The start of an agent's turn, in one call (see begin_turn in the prelude).
-- ARGV[3]: JSON object of job fields, [4]: JSON list of action ids whose results to read, or
-- null to read nothing (the job ends instead), [5]: how many of the kind, data pairs from
-- ARGV[6] on close the last turn (the rest begin this one).
return begin_turn(ARGV[3], cjson.decode(ARGV[4]), 5)
