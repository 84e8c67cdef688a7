#!lua
-- Remember, per task, the newest answer that listed it (for the task page), keeping only the
-- `limit` most recently answered tasks of one coalescing key so that nothing grows unbounded.
-- KEYS: a ax  (see keys.py)
-- ARGV: limit ttl_ms, then (taskId, at_ms, record) triples
-- Returns how many old records were dropped.
local a, ax = KEYS[1], KEYS[2]
local limit, ttl = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 3, #ARGV, 3 do
  redis.call('HSET', a, ARGV[i], ARGV[i + 2])
  redis.call('ZADD', ax, ARGV[i + 1], ARGV[i])
end
local extra = redis.call('ZCARD', ax) - limit
if extra > 0 then
  -- One by one: unpack() of a long list would overflow Lua's stack.
  for _, old in ipairs(redis.call('ZRANGE', ax, 0, extra - 1)) do
    redis.call('HDEL', a, old)
  end
  redis.call('ZREMRANGEBYRANK', ax, 0, extra - 1)
else
  extra = 0
end
redis.call('PEXPIRE', a, ttl)
redis.call('PEXPIRE', ax, ttl)
return extra
