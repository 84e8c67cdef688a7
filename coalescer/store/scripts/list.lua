-- Note activity on coalescing keys, and how long each key's data lasts at least; count what
-- ingest added to the index, and answer how large it is (see coalescer/store/census.py).
-- KEYS: co:keys {co:keys}:expiry {co:keys}:census  (one slot: see keys.py)
-- ARGV: now_ms added refused max_keys max_tasks ('' ''; no limits), then key expires_ms admit
--       triples
-- A key with admit 0 was refused a new key by apply.lua: it is noted only if listed already.
-- Both zsets change together, so that a key is in both or in neither (see unlist.lua).
-- Returns {keys listed, tasks tracked (as last counted, plus what was added since)}.
local now = ARGV[1]
local census = KEYS[3]
for i = 6, #ARGV, 3 do
  if ARGV[i + 2] == '1' or redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], now, ARGV[i])
    redis.call('ZADD', KEYS[2], 'GT', ARGV[i + 1], ARGV[i])
  end
end
if ARGV[2] ~= '0' then
  redis.call('HINCRBY', census, 'added', ARGV[2])
end
if ARGV[3] ~= '0' then
  redis.call('HINCRBY', census, 'refused', ARGV[3])
  redis.call('HSET', census, 'refused_ms', now)
end
if ARGV[4] ~= '' then -- the limits, for the processes that do not ingest (the heartbeat)
  redis.call('HSET', census, 'max_keys', ARGV[4], 'max_tasks', ARGV[5])
end
local counted = redis.call('HMGET', census, 'tracked', 'added')
return {redis.call('ZCARD', KEYS[1]), (tonumber(counted[1]) or 0) + (tonumber(counted[2]) or 0)}
