-- Drop a coalescing key from the set of keys with outbox work, unless work arrived since the
-- enforcer looked (the score it saw changed).
-- KEYS: co:outbox
-- ARGV: key seen_score
local cur = redis.call('ZSCORE', KEYS[1], ARGV[1])
if cur and tonumber(cur) == tonumber(ARGV[2]) then
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
