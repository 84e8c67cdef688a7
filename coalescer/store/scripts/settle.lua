#!lua
-- Record what the enforcer did about one victim, and acknowledge its outbox entry, atomically.
-- KEYS: v vp vx o h m rd df  (see keys.py; all under the key's hash tag)
-- ARGV: entry_id|'' group victim expected_states new_state now_ms due_ms rule saved_kind
--       started_ms definition|'' cascaded_ids
-- `expected_states` is a comma-separated list: the victim's state changes only from one of
-- them (compare-and-set, so a late or repeated report cannot undo a newer decision).
-- `due_ms` is when a held victim's claim must next be renewed. `saved_kind` ('pending',
-- 'running' or '') estimates the worker time saved from the key's recent run durations.
-- `cascaded_ids` (comma-separated) are dependents canceled with the victim: recorded too.
-- Returns {1 if the state changed else 0, milliseconds saved}.
local v, vp, vx, o, h, m, rd, df = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6],
  KEYS[7], KEYS[8]
local entry, group, id, expected, new = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local now, due, rule, kind = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8], ARGV[9]
local started, definition, cascaded = tonumber(ARGV[10]), ARGV[11], ARGV[12]

local function estimate()
  local samples = redis.call('LRANGE', rd, 0, -1)
  if #samples == 0 then
    return 0
  end
  local nums = {}
  for i, s in ipairs(samples) do
    nums[i] = tonumber(s)
  end
  table.sort(nums)
  return nums[math.floor((#nums + 1) / 2)]
end

local changed, saved = 0, 0
local rec = redis.call('HGET', v, id)
if rec then
  local head, state, tail = string.match(rec, '^([-%d]+|[^|]*|[-%d]+|%d+|[^|]*)|([^|]*)|(.*)$')
  local allowed = expected == ''
  for s in string.gmatch(expected, '[^,]+') do
    if s == state then
      allowed = true
    end
  end
  if allowed then
    redis.call('HSET', v, id, head .. '|' .. new .. '|' .. tail)
    if new == 'held' then
      redis.call('ZADD', h, due, id)
    else
      redis.call('ZREM', h, id)
    end
    if new ~= state then
      changed = 1
      redis.call('HINCRBY', m, rule .. '|' .. new, 1)
      if kind ~= '' and (new == 'superseded' or new == 'canceled') then
        saved = estimate()
        if kind == 'running' and started > 0 then
          saved = math.max(0, saved - (now - started))
        end
        redis.call('HINCRBY', m, rule .. '|saved_ms', saved)
      end
    end
  end
  if definition ~= '' then
    redis.call('HSET', df, id, definition)
  end
  local keep = redis.call('ZSCORE', vx, id)
  for dep in string.gmatch(cascaded, '[^,]+') do
    if redis.call('HEXISTS', v, dep) == 0 then
      redis.call('HSET', v, dep, table.concat(
        {0, id, -1, now, rule, 'canceled', 'cascade', 'depends on superseded ' .. id}, '|'))
      redis.call('ZADD', vp, 0, id .. '|' .. dep)
      if keep then
        redis.call('ZADD', vx, keep, dep)
      end
      redis.call('HINCRBY', m, rule .. '|cascaded', 1)
    end
  end
  local ttl = redis.call('PTTL', v)
  if ttl > 0 then
    for _, k in ipairs({df, h, m}) do
      if redis.call('PTTL', k) < ttl and redis.call('EXISTS', k) == 1 then
        redis.call('PEXPIRE', k, ttl)
      end
    end
  end
end
if entry ~= '' then
  redis.call('XACK', o, group, entry)
  redis.call('XDEL', o, entry)
end
return {changed, saved}
