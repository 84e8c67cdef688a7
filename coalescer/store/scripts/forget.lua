-- Forget tasks under one coalescing key, atomically: reconcile found the queue no longer
-- knows them (404), so no event will ever resolve them.
-- KEYS: t p w d x  (see keys.py)
-- ARGV: taskId...
-- Returns how many of the tasks the index held.
local t, p, w, d, x = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local held = 0
for _, id in ipairs(ARGV) do
  held = held + redis.call('HDEL', t, id)
  redis.call('ZREM', p, id)
  redis.call('ZREM', w, id)
  redis.call('ZREM', d, id)
  redis.call('ZREM', x, id)
end
return held
