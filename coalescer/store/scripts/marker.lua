#!lua
-- Read the index's state marker, creating it as 'lost' when it is missing: a store without the
-- marker is new or was emptied (a restart without persistence, FLUSHALL), and holds no task
-- that was pending before now. Only a completed rebuild from the queue sets 'ok'.
-- KEYS: index  (co:index)
-- ARGV: now_ms  [rebuild_started_ms]
-- With rebuild_started_ms, mark the index rebuilt, unless it was found lost after the rebuild
-- started (the rebuild then did not cover the loss).
-- Returns {state, since_ms, rebuilt_ms, created (0|1)}.
local m, now = KEYS[1], ARGV[1]
local created = 0
if redis.call('EXISTS', m) == 0 then
  redis.call('HSET', m, 'state', 'lost', 'since_ms', now)
  created = 1
end
local started = tonumber(ARGV[2])
if started and tonumber(redis.call('HGET', m, 'since_ms')) <= started then
  redis.call('HSET', m, 'state', 'ok', 'rebuilt_ms', now)
end
local v = redis.call('HMGET', m, 'state', 'since_ms', 'rebuilt_ms')
return {v[1] or '', v[2] or '', v[3] or '', created}
