#!lua
-- Record a bisection: the search a failed primary's superseding side ran over the pushes it
-- held, to locate the first failing one (see coalescer/store/bisections.py).
-- KEYS: b (co:{K}:b)  bt (co:{K}:bt)
-- ARGV: primary  located_ms  finding_json  ttl_ms  keep  task_id...
-- b holds primary -> finding, n:<primary> -> the task_ids it names (space-separated), and
-- t:<task_id> -> primary for each of them; bt orders the primaries by when their finding was
-- located. A repeat of the same finding (a retry) changes nothing but the expiry. Only the
-- newest `keep` findings are kept, with the lookups that point at them.
-- Returns 1 when the finding is new (not the same finding again), else 0.
local b, bt = KEYS[1], KEYS[2]
local primary, at, finding, ttl, keep = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local new = redis.call('HGET', b, primary) ~= finding and 1 or 0
local named = {}
for i = 6, #ARGV do
  redis.call('HSET', b, 't:' .. ARGV[i], primary)
  named[#named + 1] = ARGV[i]
end
redis.call('HSET', b, primary, finding, 'n:' .. primary, table.concat(named, ' '))
redis.call('ZADD', bt, at, primary)
local extra = redis.call('ZCARD', bt) - keep
if extra > 0 then
  for _, old in ipairs(redis.call('ZRANGE', bt, 0, extra - 1)) do
    for t in string.gmatch(redis.call('HGET', b, 'n:' .. old) or '', '%S+') do
      if redis.call('HGET', b, 't:' .. t) == old then
        redis.call('HDEL', b, 't:' .. t)
      end
    end
    redis.call('HDEL', b, old, 'n:' .. old)
  end
  redis.call('ZREMRANGEBYRANK', bt, 0, extra - 1)
end
redis.call('PEXPIRE', b, ttl)
redis.call('PEXPIRE', bt, ttl)
return new
