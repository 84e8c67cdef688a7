-- Note activity on coalescing keys, and how long each key's data lasts at least.
-- KEYS: co:keys {co:keys}:expiry  (one slot: see keys.py)
-- ARGV: now_ms, then key expires_ms pairs
-- Both zsets change together, so that a key is in both or in neither (see unlist.lua).
local now = ARGV[1]
for i = 2, #ARGV, 2 do
  redis.call('ZADD', KEYS[1], now, ARGV[i])
  redis.call('ZADD', KEYS[2], 'GT', ARGV[i + 1], ARGV[i])
end
return #ARGV / 2
