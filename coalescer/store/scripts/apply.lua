#!lua
-- Apply one task event to one coalescing key, atomically.
-- KEYS: t p w d x  (see keys.py)
-- ARGV: taskId runId rank state order deadline_ms since_ms now_ms grace_ms reason
-- Returns 'applied', 'stale' (version not newer than the stored one) or 'expired' (past
-- deadline plus grace: forgotten for good, so a late duplicate cannot resurrect it).
local t, p, w, d, x = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local id, run, rank = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local state, order = ARGV[4], ARGV[5]
local deadline, since = tonumber(ARGV[6]), ARGV[7]
local now, grace = tonumber(ARGV[8]), tonumber(ARGV[9])

-- Forget tasks past deadline + grace, a bounded batch per call.
for _, old in ipairs(redis.call('ZRANGEBYSCORE', x, '-inf', now - grace, 'LIMIT', 0, 64)) do
  redis.call('HDEL', t, old)
  redis.call('ZREM', p, old)
  redis.call('ZREM', w, old)
  redis.call('ZREM', d, old)
  redis.call('ZREM', x, old)
end
if deadline + grace <= now then
  return 'expired'
end

local cur = redis.call('HGET', t, id)
if cur then
  local crun, crank, corder = string.match(cur, '^(%d+)|(%d+)|([^|]*)|')
  crun, crank = tonumber(crun), tonumber(crank)
  if run < crun or (run == crun and rank <= crank) then
    return 'stale'
  end
  order = corder -- a task keeps its place: retried runs are pending again where they were
end

redis.call('HSET', t, id, table.concat({run, rank, order, deadline, since, state, ARGV[10]}, '|'))
redis.call('ZADD', x, deadline, id)
if rank == 1 and deadline > now then
  redis.call('ZADD', p, order, id)
  redis.call('ZADD', w, since, id)
  redis.call('ZADD', d, deadline, id)
else
  redis.call('ZREM', p, id)
  redis.call('ZREM', w, id)
  redis.call('ZREM', d, id)
end

-- Nothing outlives the newest deadline + grace it holds.
local ttl = deadline + grace - now
for _, k in ipairs(KEYS) do
  local cur_ttl = redis.call('PTTL', k)
  if cur_ttl ~= -2 and cur_ttl < ttl then
    redis.call('PEXPIRE', k, ttl)
  end
end
return 'applied'
