-- ARGV[3..]: kind, data, kind, data ... Returns the last seq.
local seq = 0
for i = 3, #ARGV, 2 do seq = emit(ARGV[i], ARGV[i + 1]) end
return seq
