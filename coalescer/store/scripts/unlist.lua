-- Forget a coalescing key whose data has expired, unless it got newer tasks since the sweeper
-- looked (its expiry time is no longer the one the sweeper saw).
-- KEYS: co:keys {co:keys}:expiry
-- ARGV: key seen_expires_ms
-- Returns 1 if the key was forgotten, else 0.
local cur = redis.call('ZSCORE', KEYS[2], ARGV[1])
if cur and tonumber(cur) == tonumber(ARGV[2]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('ZREM', KEYS[2], ARGV[1])
  return 1
end
return 0
