#!lua
-- Record what the enforcer did about one victim, and acknowledge its outbox entry, atomically.
-- KEYS: v vp vx o h m rd df vn bs t p w d  (see keys.py; all under the key's hash tag)
-- ARGV: entry_id|'' group victim expected_states new_state now_ms due_ms rule saved_kind
--       started_ms definition|'' cascaded_ids resolution|'' offer('1'|'')
-- `resolution` is `how|why`: how the victim's run was ended, and why (kept in `vn` as
-- `run|how|why`, so that a later decision about a newer run does not show it).
-- `expected_states` is a comma-separated list: the victim's state changes only from one of
-- them (compare-and-set, so a late or repeated report cannot undo a newer decision).
-- `due_ms` is when a held victim's claim must next be renewed. `saved_kind` ('pending',
-- 'running' or '') estimates the worker time saved from the key's recent run durations.
-- `cascaded_ids` (comma-separated) are dependents canceled with the victim: recorded too.
-- `offer` '1': the victim was released while its run is pending still (one that waited
-- unclaimed, `hold-by: priority`: no new run announces it): offered again, as a new run's
-- event would, if the index holds that run as pending.
-- Returns {1 if the state changed else 0, milliseconds saved}.
--
-- With ARGV[1] 'search', one step of a bisection instead (coalescer/policy/bisecting.py):
-- ARGV: 'search' primary expected_record new_record|'' now cascade protect_ms supersede_running
--       then, per victim it moves, 8 values: victim expected_state new_state action by by_run
--       reason emit('1': add an outbox entry for `action`)
-- The search's record (`bs`, under the primary) is replaced by `new_record` (deleted when '')
-- only if it still is `expected_record` (compare-and-set: a step repeated after a crash, or by
-- a second enforcer, finds it changed and does nothing); then each victim still in its
-- expected state moves (`action`, `by`, `reason` kept when ''). Returns {1} or {0}.
local v, vp, vx, o, h, m, rd, df, vn = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6],
  KEYS[7], KEYS[8], KEYS[9]
local HELD = {held = true, bisecting = true}

if ARGV[1] == 'search' then
  local bs = KEYS[10]
  local primary, expected, record, now = ARGV[2], ARGV[3], ARGV[4], ARGV[5]
  if (redis.call('HGET', bs, primary) or '') ~= expected then
    return {0}
  end
  if record == '' then
    redis.call('HDEL', bs, primary)
  else
    redis.call('HSET', bs, primary, record)
  end
  for i = 9, #ARGV, 8 do
    local id, was, new, action = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
    local by, byrun, reason, emit = ARGV[i + 4], ARGV[i + 5], ARGV[i + 6], ARGV[i + 7]
    local rec = redis.call('HGET', v, id)
    local f = {}
    if rec then
      f = {string.match(rec, '^([-%d]+)|([^|]*)|([-%d]+)|(%d+)|([^|]*)|([^|]*)|([^|]*)|(.*)$')}
    end
    if f[6] == was then
      if by ~= '' and (by ~= f[2] or byrun ~= f[3]) then
        -- The run that stands for it, even when it is the task it was held for: a newer run
        -- of that task (the one that ran for the search) is named, not the held one.
        if by ~= f[2] then
          redis.call('ZREM', vp, f[2] .. '|' .. id)
          redis.call('ZADD', vp, 0, by .. '|' .. id)
        end
        f[2], f[3] = by, byrun
      end
      f[6] = new
      if action ~= '' then
        f[7] = action
      end
      if reason ~= '' then
        f[8] = reason
      end
      redis.call('HSET', v, id, table.concat(f, '|'))
      if HELD[new] then
        redis.call('ZADD', h, 'NX', now, id)
      else
        redis.call('ZREM', h, id)
      end
      if new ~= was then
        redis.call('HINCRBY', m, f[5] .. '|' .. new, 1)
      end
      if emit == '1' then
        redis.call('XADD', o, '*', 'a', f[7], 'v', id, 'r', f[1], 'p', f[2], 'pr', f[3],
          'rule', f[5], 'why', f[8], 'c', ARGV[6], 'pt', ARGV[7], 'sr', ARGV[8])
      end
    end
  end
  return {1}
end

-- With ARGV[1] 'reserve', a bisection takes a task of this key that it runs again (a push of
-- its gap, superseded or canceled earlier, or one whose dependency it reruns):
-- ARGV: 'reserve' taskId run by rule reason now expire_ms undo('1': give it back)
-- The task becomes `probing` for `by` (the search's primary), so decide.lua hides its coming
-- run from decisions; refused ({0}) while a decision about it is under way (held, decided,
-- settling, another search's). With `undo`, a task still `probing` for `by` becomes `ran`.
if ARGV[1] == 'reserve' then
  local id, run, by, rrule, reason = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
  local now, expire, undo = ARGV[7], ARGV[8], ARGV[9] == '1'
  local rec = redis.call('HGET', v, id)
  local f = {}
  if rec then
    f = {string.match(rec, '^([-%d]+)|([^|]*)|([-%d]+)|(%d+)|([^|]*)|([^|]*)|([^|]*)|(.*)$')}
  end
  local mine = f[6] == 'probing' and f[2] == by
  if undo then
    if not mine then
      return {0}
    end
    f[6] = 'ran'
    redis.call('HSET', v, id, table.concat(f, '|'))
    redis.call('HINCRBY', m, f[5] .. '|ran', 1)
    return {1}
  end
  if mine then
    return {1}
  end
  local BUSY = {decided = true, settling = true, held = true, bisecting = true, probing = true}
  if f[6] and BUSY[f[6]] then
    return {0}
  end
  if f[2] and f[2] ~= '' then
    redis.call('ZREM', vp, f[2] .. '|' .. id)
  end
  redis.call('HSET', v, id, table.concat(
    {run, by, -1, now, rrule, 'probing', 'bisect', reason}, '|'))
  if by ~= id then
    redis.call('ZADD', vp, 0, by .. '|' .. id)
  end
  redis.call('ZADD', vx, expire, id)
  redis.call('HINCRBY', m, rrule .. '|probing', 1)
  return {1}
end

local entry, group, id, expected, new = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local now, due, rule, kind = tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8], ARGV[9]
local started, definition, cascaded = tonumber(ARGV[10]), ARGV[11], ARGV[12]
local resolution, offer = ARGV[13], ARGV[14] == '1'

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
    if HELD[new] then
      redis.call('ZADD', h, due, id)
    else
      redis.call('ZREM', h, id)
    end
    if new ~= state then
      changed = 1
      redis.call('HINCRBY', m, rule .. '|' .. new, 1)
      if new == 'released' and offer then
        local t, p, w, d = KEYS[11], KEYS[12], KEYS[13], KEYS[14]
        local run = tonumber(string.match(head, '^([-%d]+)|'))
        local cur = redis.call('HGET', t, id)
        local crun, crank, order, deadline, since
        if cur then
          crun, crank, order, deadline, since = string.match(cur, '^(%d+)|(%d+)|([^|]*)|([^|]*)|([^|]*)|')
        end
        if crank == '1' and tonumber(crun) == run and tonumber(deadline) > now then
          redis.call('ZADD', p, order, id)
          redis.call('ZADD', w, since, id)
          redis.call('ZADD', d, deadline, id)
        end
      end
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
  local run = head and string.match(head, '^([-%d]+)|') or -1
  if resolution ~= '' then
    redis.call('HSET', vn, id, run .. '|' .. resolution)
  end
  local keep = redis.call('ZSCORE', vx, id)
  for dep in string.gmatch(cascaded, '[^,]+') do
    if redis.call('HEXISTS', v, dep) == 0 then
      redis.call('HSET', v, dep, table.concat(
        {0, id, run, now, rule, 'canceled', 'cascade', 'depends on superseded ' .. id}, '|'))
      redis.call('ZADD', vp, 0, id .. '|' .. dep)
      if keep then
        redis.call('ZADD', vx, keep, dep)
      end
      redis.call('HINCRBY', m, rule .. '|cascaded', 1)
    end
  end
  local ttl = redis.call('PTTL', v)
  if ttl > 0 then
    for _, k in ipairs({df, vn, h, m}) do
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
