-- Give back a slot of a cap on actions running at once and take the waiting calls that may now run (see
-- store.give_slot). KEYS as slot_take.lua. ARGV[1]: holder, [2]: now, [3]: limit.
-- Returns the waiting entries to send (each still takes its slot when it runs).
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', ARGV[2])
local free = tonumber(ARGV[3]) - redis.call('ZCARD', KEYS[1])
local out = {}
while free > 0 do
  local entry = redis.call('LPOP', KEYS[2])
  if not entry then break end
  table.insert(out, entry)
  free = free - 1
end
return out
