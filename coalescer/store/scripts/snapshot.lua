-- Read what one superseding query needs, in one round trip.
-- KEYS: t p w d
-- ARGV: initial_taskId (or '') now_ms cap (-1: no cap) [wait: '0' leaves oldest_since_ms false]
-- Returns {pending_count, oldest_since_ms|false, newer, rank, ids}: `ids`, the newest `cap`
-- pending taskIds, newest first, separated by spaces; `newer`, how many pending tasks (other
-- than the initial one) come after the initial task in the key's order, or -1 when the index
-- does not know the initial task; `rank`, the state rank of the initial task's newest known run
-- (0: unknown). Pending tasks past their deadline are dropped first: the queue has resolved
-- them, whether or not that event has arrived.
local t, p, w, d = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
-- Arguments go to redis.call as the strings they came as: a Lua number would be formatted
-- anew on every call.
local initial, now, cap = ARGV[1], ARGV[2], ARGV[3]
-- The oldest wait only matters to a query with an age threshold, and Redis formats the score.
local wait = ARGV[4] ~= '0'

-- Whether taskId `a` comes before `b` byte by byte, as Redis orders a sorted set's members and
-- the model orders ties. Lua's `<` on strings follows the server's locale (`strcoll`): under
-- en_US.UTF-8, for one, 'a' < 'B'. (decide.lua has the same; scripts cannot share code.)
local function id_before(a, b)
  local i = 1
  while i <= #a and string.byte(a, i) == string.byte(b, i) do
    i = i + 1
  end
  return (string.byte(a, i) or -1) < (string.byte(b, i) or -1)
end

for _, old in ipairs(redis.call('ZRANGEBYSCORE', d, '-inf', now, 'LIMIT', '0', '256')) do
  redis.call('ZREM', p, old)
  redis.call('ZREM', w, old)
  redis.call('ZREM', d, old)
end

local out = {redis.call('ZCARD', p), false, -1, 0}
if wait then
  local oldest = redis.call('ZRANGE', w, 0, 0, 'WITHSCORES')
  if oldest[2] then
    out[2] = oldest[2]
  end
end

if initial ~= '' then
  local cur = redis.call('HGET', t, initial)
  if cur then
    -- Counted, not read from scores: Redis formats every score it returns, which would cost
    -- more than the rest of the script.
    local rank, mine = string.match(cur, '^%d+|(%d+)|([^|]*)|')
    local newer = redis.call('ZCOUNT', p, '(' .. mine, '+inf')
    for _, id in ipairs(redis.call('ZRANGEBYSCORE', p, mine, mine)) do
      if id_before(initial, id) then
        newer = newer + 1
      end
    end
    out[3] = newer
    out[4] = tonumber(rank)
  end
end

local stop = tonumber(cap) - 1
if stop < 0 then
  stop = -1
end
-- One string, the ids separated by spaces: returning them one by one costs Redis more than the
-- rest of the script (each is converted into Lua and back).
out[5] = table.concat(redis.call('ZREVRANGE', p, 0, stop), ' ')
return out
