-- A key's pending count and the time its longest-waiting pending task became pending, for the
-- overview page and /metrics.
-- KEYS: t p w d
-- ARGV: now_ms [tracked]
-- Returns {pending_count, oldest_since_ms|false, tasks tracked (with ARGV[2] = 1, else 0)}. Pending tasks past their deadline are
-- dropped first, as in snapshot.lua: the queue has resolved them.
local p, w, d = KEYS[2], KEYS[3], KEYS[4]
local now = tonumber(ARGV[1])
for _, old in ipairs(redis.call('ZRANGEBYSCORE', d, '-inf', now, 'LIMIT', 0, 256)) do
  redis.call('ZREM', p, old)
  redis.call('ZREM', w, old)
  redis.call('ZREM', d, old)
end
local out = {redis.call('ZCARD', p), false, ARGV[2] == '1' and redis.call('HLEN', KEYS[1]) or 0}
local oldest = redis.call('ZRANGE', w, 0, 0, 'WITHSCORES')
if oldest[2] then
  out[2] = oldest[2]
end
return out
