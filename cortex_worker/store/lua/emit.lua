-- ARGV[3]: '1' to log only while the job has not ended (a turn's output), [4..]: kind, data,
-- kind, data ... Returns the last seq, or 0 if nothing was logged.
if ARGV[3] == '1' and job_ended() then return 0 end
local seq = 0
for i = 4, #ARGV, 2 do seq = emit(ARGV[i], ARGV[i + 1]) end
return seq
