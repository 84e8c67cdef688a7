#!lua
-- Add to (or set) buckets of a history ring, atomically (see coalescer/history.py).
-- KEYS: ring  (a hash: `<series>:<slot>` -> `<bucket start ms>|<value>`; see keys.py)
-- ARGV: buckets bucket_ms ttl_ms, then (series, start_ms, 'add'|'set', value) quads
-- A bucket newer than the one in its slot takes the slot over; an older one is dropped (it is
-- past the retention). Returns how many buckets were dropped so.
local ring = KEYS[1]
local buckets, width, ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local dropped = 0
for i = 4, #ARGV, 4 do
  local start, mode, value = tonumber(ARGV[i + 1]), ARGV[i + 2], tonumber(ARGV[i + 3])
  local field = ARGV[i] .. ':' .. math.floor(start / width) % buckets
  local cur = redis.call('HGET', ring, field)
  local cur_start, cur_value = -1, 0
  if cur then
    local s, v = string.match(cur, '^(%d+)|(.*)$')
    cur_start, cur_value = tonumber(s), tonumber(v) or 0
  end
  if start < cur_start then
    dropped = dropped + 1
  else
    if start == cur_start and mode == 'add' then
      value = cur_value + value
    end
    redis.call('HSET', ring, field, string.format('%d|%.17g', start, value))
  end
end
redis.call('PEXPIRE', ring, ttl)
return dropped
