#!lua
-- One enforcer at a time per coalescing key: acquire, renew or release its lease.
-- KEYS: lease
-- ARGV: acquire|renew|release  holder  ttl_ms
-- Returns 1 when `holder` holds the lease afterwards (or, for release, held it), else 0.
local lease, mode, me, ttl = KEYS[1], ARGV[1], ARGV[2], tonumber(ARGV[3])
local cur = redis.call('GET', lease)
if mode == 'acquire' and not cur then
  redis.call('SET', lease, me, 'PX', ttl)
  return 1
end
if cur ~= me then
  return 0
end
if mode == 'release' then
  redis.call('DEL', lease)
else
  redis.call('PEXPIRE', lease, ttl)
end
return 1
