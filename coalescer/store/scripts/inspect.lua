-- A key's pending tasks in order, with what the index knows of each, for pages and JSON.
-- KEYS: t p w d
-- ARGV: now_ms limit
-- Returns {id1, record1, id2, record2, ...} oldest first (records as stored in `t`).
local t, p, w, d = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local now, limit = tonumber(ARGV[1]), tonumber(ARGV[2])
for _, old in ipairs(redis.call('ZRANGEBYSCORE', d, '-inf', now, 'LIMIT', 0, 256)) do
  redis.call('ZREM', p, old)
  redis.call('ZREM', w, old)
  redis.call('ZREM', d, old)
end
local out = {}
for _, id in ipairs(redis.call('ZRANGE', p, 0, limit - 1)) do
  out[#out + 1] = id
  out[#out + 1] = redis.call('HGET', t, id) or ''
end
return out
