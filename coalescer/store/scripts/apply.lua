#!lua
-- Apply task events to one coalescing key, each atomically, in the order given: what one call
-- per event would do, in one call (a batch's events of one key share the sweep, the TTLs and
-- the log's upkeep).
-- KEYS: t p w d x res  (see keys.py)
-- ARGV: now_ms grace_ms log_length new_key new_tasks, then per event (8 each):
--       taskId runId rank state order deadline_ms since_ms reason
-- new_key: 1 when the index may grow by this key (if it holds nothing of it); new_tasks: how
-- many tasks this key does not know yet it may add (see coalescer/store/census.py).
-- Returns, per event, 'applied' ('added' when the task is new to the key), 'stale' (version
-- not newer than the stored one), 'expired' (past deadline plus grace: forgotten for good, so
-- a late duplicate cannot resurrect it) or 'limited' (a task new to the key, past new_tasks;
-- 'limited-key' when new_key refused the key itself): nothing of it is written.
-- With log_length > 0, every resolution event (rank 3), whatever its outcome, is also logged
-- in res (newest first, log_length kept), which lives until its last one's deadline + grace.
local t, p, w, d, x, res = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local now, grace, log_length = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local HEAD, FIELDS = 5, 8
local n = (#ARGV - HEAD) / FIELDS
-- A key that holds something is no new key, even if all of it expires just below.
local room, refusal = tonumber(ARGV[5]), 'limited'
if ARGV[4] ~= '1' and redis.call('EXISTS', t) == 0 then
  room, refusal = 0, 'limited-key'
end
-- Variadic commands take at most this many members at once (Lua's stack limit).
local CHUNK = 1000

local function each_chunk(command, key, members)
  for from = 1, #members, CHUNK do
    redis.call(command, key, unpack(members, from, math.min(from + CHUNK - 1, #members)))
  end
end

-- Forget tasks past deadline + grace, a bounded batch per event. None of this call's events
-- can touch them (an event past its deadline + grace is 'expired' before it reads anything).
local old = redis.call('ZRANGEBYSCORE', x, '-inf', now - grace, 'LIMIT', 0, 64 * n)
if #old > 0 then
  each_chunk('HDEL', t, old)
  each_chunk('ZREM', p, old)
  each_chunk('ZREM', w, old)
  each_chunk('ZREM', d, old)
  each_chunk('ZREM', x, old)
end

local outcomes = {}
local ttl = nil -- the newest deadline + grace - now among the applied events
local logged, log_ttl, log_cleared = {}, nil, false
for i = 0, n - 1 do
  local b = HEAD + i * FIELDS
  local id, run, rank = ARGV[b + 1], tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  local state, order = ARGV[b + 4], ARGV[b + 5]
  local deadline, since = tonumber(ARGV[b + 6]), ARGV[b + 7]
  local outcome, crank, cdeadline = 'applied', nil, nil
  if deadline + grace <= now then
    outcome = 'expired'
  else
    local cur = redis.call('HGET', t, id)
    if not cur and room <= 0 then
      outcome = refusal
    elseif not cur then
      room = room - 1
    else
      local crun, corder
      crun, crank, corder, cdeadline = string.match(cur, '^(%d+)|(%d+)|([^|]*)|([^|]*)|')
      crun, crank = tonumber(crun), tonumber(crank)
      if run < crun or (run == crun and rank <= crank) then
        outcome = 'stale'
      else
        order = corder -- a task keeps its place: retried runs are pending again where they were
      end
    end
  end
  if outcome == 'applied' then
    -- Numbers as the caller wrote them: formatting Lua's numbers costs more than the writes.
    redis.call('HSET', t, id, ARGV[b + 2] .. '|' .. ARGV[b + 3] .. '|' .. order .. '|' ..
      ARGV[b + 6] .. '|' .. since .. '|' .. state .. '|' .. ARGV[b + 8])
    if cdeadline ~= ARGV[b + 6] then -- a known task is in x already, by the same deadline
      redis.call('ZADD', x, deadline, id)
    end
    if rank == 1 and deadline > now then
      redis.call('ZADD', p, order, id)
      redis.call('ZADD', w, since, id)
      redis.call('ZADD', d, deadline, id)
    elseif crank == nil or crank == 1 then
      -- Only a task held as pending can be in p, w and d (every script keeps it so).
      redis.call('ZREM', p, id)
      redis.call('ZREM', w, id)
      redis.call('ZREM', d, id)
    end
    if ttl == nil or deadline + grace - now > ttl then
      ttl = deadline + grace - now
    end
  end
  outcomes[i + 1] = (outcome == 'applied' and crank == nil) and 'added' or outcome
  if log_length > 0 and rank == 3 and outcome ~= refusal then
    local entry_ttl = deadline + grace - now
    if entry_ttl > 0 then
      logged[#logged + 1] = table.concat({ARGV[1], 'resolved', id, ARGV[b + 2], state, ARGV[b + 8]}, '|')
      log_ttl = entry_ttl
    else -- an expiry of 0 or less deletes the log, and what came before in it
      logged, log_ttl, log_cleared = {}, nil, true
    end
  end
end

-- Nothing outlives the newest deadline + grace it holds.
if ttl ~= nil then
  for k = 1, 5 do
    local cur_ttl = redis.call('PTTL', KEYS[k])
    if cur_ttl ~= -2 and cur_ttl < ttl then
      redis.call('PEXPIRE', KEYS[k], ttl)
    end
  end
end

if log_cleared then
  redis.call('DEL', res)
end
if #logged > 0 then
  -- Only the newest log_length entries would survive the trim.
  local from = math.max(1, #logged - log_length + 1)
  redis.call('LPUSH', res, unpack(logged, from))
  redis.call('LTRIM', res, 0, log_length - 1)
  redis.call('PEXPIRE', res, log_ttl)
end
return outcomes
