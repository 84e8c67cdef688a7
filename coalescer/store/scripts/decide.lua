#!lua
-- Take a superseding policy's decisions for one coalescing key, atomically, right after an
-- event was applied to it (or on a tick, without an event: age thresholds, lost events).
-- KEYS: t p w d x v vp vx r rs o h m rd bs  (see keys.py; all under the key's hash tag)
-- ARGV: now_ms grace_ms rule strategy age_ms size supersede_running protect_ms hold cascade
--       confirm confidence parallel event_taskId|'' started_ms resolved_ms max_decisions
-- `hold`: 0 supersede at once, 1 hold victims until the primary ends (release), 2 hold them
-- and, when the primary fails, start a bisection over them (`bs`; carried on by the enforcer,
-- coalescer/policy/bisecting.py), whose failures are confirmed by up to `confirm` reruns each,
-- until they are `confidence` probably a breakage (coalescer/verdicts.py).
-- A primary whose search is under way (in `bs`) is hidden as a bisection's victims are: a
-- rerun confirming its failure is neither offered, nor a primary, nor decided.
-- Returns {decisions taken now, outstanding outbox work (stream entries + held victims +
-- bisections under way)}.
--
-- Decisions depend on the index's state only, never on the event or its arrival order, and a
-- task run is decided at most once (`v` remembers it), so duplicated, re-ordered or concurrent
-- calls, from any number of processes, take each decision exactly once.
local t, p, w, d, x = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local v, vp, vx, r, rs = KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local o, h, m, rd, bs = KEYS[11], KEYS[12], KEYS[13], KEYS[14], KEYS[15]
local now, grace = tonumber(ARGV[1]), tonumber(ARGV[2])
local rule, strategy = ARGV[3], ARGV[4]
local age, size = tonumber(ARGV[5]), tonumber(ARGV[6])
local srun, protect = ARGV[7] == '1', tonumber(ARGV[8])
local hold, bisect = ARGV[9] == '1' or ARGV[9] == '2', ARGV[9] == '2'
local cascade, confirm, confidence = ARGV[10], tonumber(ARGV[11]), tonumber(ARGV[12])
local parallel, ev = tonumber(ARGV[13]), ARGV[14]
local started, resolved, cap = tonumber(ARGV[15]), tonumber(ARGV[16]), tonumber(ARGV[17])

-- A record of `t`: run|rank|order|deadline|since|state|reason.
local function task(id)
  local rec = redis.call('HGET', t, id)
  if not rec then
    return nil
  end
  local run, rank, order, deadline, _, state, reason =
    string.match(rec, '^(%d+)|(%d+)|([^|]*)|(%d+)|([^|]*)|([^|]*)|(.*)$')
  return {id = id, run = tonumber(run), rank = tonumber(rank), order = tonumber(order),
          deadline = tonumber(deadline), state = state, reason = reason}
end

-- A record of `v` (what superseded a task): run|by|by_run|at|rule|state|action|reason.
local function victim(id)
  local rec = redis.call('HGET', v, id)
  if not rec then
    return nil
  end
  local run, by, byrun, at, vrule, state, action, reason =
    string.match(rec, '^([-%d]+)|([^|]*)|([-%d]+)|(%d+)|([^|]*)|([^|]*)|([^|]*)|(.*)$')
  if not run then
    return nil
  end
  return {run = tonumber(run), by = by, byrun = byrun, at = at, rule = vrule, state = state,
          action = action, reason = reason}
end

local function save(id, rec)
  redis.call('HSET', v, id, table.concat(
    {rec.run, rec.by, rec.byrun, rec.at, rec.rule, rec.state, rec.action, rec.reason}, '|'))
end

-- Whether taskId `a` comes before `b` byte by byte, as Redis orders a sorted set's members and
-- the model orders ties. Lua's `<` on strings follows the server's locale (`strcoll`): under
-- en_US.UTF-8, for one, 'a' < 'B'. (snapshot.lua has the same; scripts cannot share code.)
local function id_before(a, b)
  local i = 1
  while i <= #a and string.byte(a, i) == string.byte(b, i) do
    i = i + 1
  end
  return (string.byte(a, i) or -1) < (string.byte(b, i) or -1)
end

-- Until the enforcer is done with it, a victim is neither offered nor a primary. A bisection's
-- victims (held for it, or released to run for it) are neither until the search is over.
local LIVE = {decided = true, settling = true, held = true, superseded = true, canceled = true,
              bisecting = true, probing = true}
local function live_victim(id)
  local rec = victim(id)
  return rec ~= nil and LIVE[rec.state] == true
end

-- A failed primary whose bisection is under way: its failure may be confirmed by a rerun.
local searching = redis.call('HLEN', bs) > 0
local function under_search(id)
  return searching and redis.call('HEXISTS', bs, id) == 1
end

local function hide(id)
  redis.call('ZREM', p, id)
  redis.call('ZREM', w, id)
  redis.call('ZREM', d, id)
  redis.call('ZREM', r, id)
end

local function emit(action, id, run, by, byrun, why, of_rule)
  redis.call('XADD', o, '*', 'a', action, 'v', id, 'r', run, 'p', by, 'pr', byrun,
    'rule', of_rule or rule, 'why', why, 'c', cascade, 'pt', protect, 'sr', srun and 1 or 0)
end

-- Forget lineage past its task's deadline plus grace, a bounded batch per call.
for _, old in ipairs(redis.call('ZRANGEBYSCORE', vx, '-inf', now, 'LIMIT', 0, 64)) do
  local rec = victim(old)
  if rec then
    redis.call('ZREM', vp, rec.by .. '|' .. old)
  end
  redis.call('HDEL', v, old)
  redis.call('ZREM', vx, old)
  redis.call('ZREM', h, old)
end

-- Victims held for `by` follow it once it ends: superseded by it when it completed (and, down
-- the chain, everything held for them, superseded by the same final primary), released
-- otherwise. A primary that is itself a victim is not an end: its own primary decides. A
-- released victim's held ones follow when its run ends; a canceled or superseded one's run
-- ended already, and so did a held one whose run was ended by someone else (canceled, past
-- its deadline) while its end was hidden: those held for it follow the final primary's end
-- either way.
local function run_ended(id, rec)
  if rec.state == 'canceled' or rec.state == 'superseded' then
    return true
  end
  local cur = task(id)
  return cur ~= nil and cur.rank == 3 and cur.run == rec.run
end

-- How deep chains of held victims are followed (a victim held for a victim held for ...): as
-- deep as a key's decisions can make them, with a bound that keeps a corrupt cycle finite.
local MAX_CHAIN = 1024

-- `upto`, if given, limits the first level to victims decided while `by` was at that run or an
-- earlier one (not those decided since for a newer run of `by`).
local function settle_held(by, final, finalrun, outcome, depth, upto)
  local members = redis.call('ZRANGEBYLEX', vp, '[' .. by .. '|', '[' .. by .. '|\255')
  for _, member in ipairs(members) do
    local id = string.sub(member, #by + 2)
    local rec = victim(id)
    if rec and upto and tonumber(rec.byrun) > upto then
      rec = nil
    end
    if rec and (rec.state == 'held' or (rec.state == 'decided' and rec.action == 'hold')) then
      rec.state, rec.action = 'settling', outcome
      save(id, rec)
      emit(outcome, id, rec.run, final, finalrun, 'primary ' .. final .. ' ended', rec.rule)
    end
    if rec and (outcome == 'supersede' or run_ended(id, rec)) and depth < MAX_CHAIN then
      settle_held(id, final, finalrun, outcome, depth + 1)
    end
  end
end

-- A primary that ended in exception (canceled, deadline, malformed payload...) produced no
-- result that could stand for anyone: its victims not yet carried out go back to the index,
-- and may be decided anew (a released run is the one case where a run is decided twice).
local function release_decided(by)
  local members = redis.call('ZRANGEBYLEX', vp, '[' .. by .. '|', '[' .. by .. '|\255')
  for _, member in ipairs(members) do
    local id = string.sub(member, #by + 2)
    local rec = victim(id)
    local cur = task(id)
    if rec and rec.state == 'decided' and cur then
      rec.state, rec.reason = 'released', 'primary ' .. by .. ' ended in exception'
      save(id, rec)
      if cur.rank == 1 and cur.run == rec.run and cur.deadline > now then
        local since = string.match(redis.call('HGET', t, id), '^[^|]*|[^|]*|[^|]*|[^|]*|([^|]*)|')
        redis.call('ZADD', p, cur.order, id)
        redis.call('ZADD', w, since, id)
        redis.call('ZADD', d, cur.deadline, id)
      elseif cur.rank == 2 and cur.run == rec.run then
        redis.call('ZADD', r, cur.order, id)
      end
    end
  end
end

-- A bisection (`hold` 2) after `by`, whose run `cur` failed: every victim held for it, down
-- its chains, becomes `bisecting` (still held and renewed, in `h`), and the search's record is
-- written under `by` in `bs`, for the enforcer to carry on, held victims or none (the enforcer
-- adds the pushes of the gap that nothing held, or ends the search when there are none).
-- Returns true. A duplicate event finds it started, or finished (its victims no longer held),
-- and changes nothing. Task ids and rule names need no JSON escaping.
local function start_search(by, cur, started_ms)
  if redis.call('HEXISTS', bs, by) == 1 then
    return true
  end
  local found = {}
  local function gather(of, depth)
    local members = redis.call('ZRANGEBYLEX', vp, '[' .. of .. '|', '[' .. of .. '|\255')
    for _, member in ipairs(members) do
      local id = string.sub(member, #of + 2)
      local rec = victim(id)
      local known = task(id)
      if rec and (rec.state == 'held' or (rec.state == 'decided' and rec.action == 'hold')) then
        if known then
          found[#found + 1] = {id = id, rec = rec, order = known.order, deadline = known.deadline}
        else
          rec.state, rec.action = 'settling', 'release'
          save(id, rec)
          emit('release', id, rec.run, by, cur.run, 'primary ' .. by .. ' ended', rec.rule)
        end
      end
      if rec and depth < MAX_CHAIN then
        gather(id, depth + 1)
      end
    end
  end
  gather(by, 0)
  table.sort(found, function(a, b)
    return a.order < b.order or (a.order == b.order and id_before(a.id, b.id))
  end)
  local parts = {}
  for i, f in ipairs(found) do
    f.rec.state, f.rec.action = 'bisecting', 'bisect'
    save(f.id, f.rec)
    redis.call('ZADD', h, 'NX', now, f.id)
    parts[i] = '["' .. f.id .. '",' .. f.rec.run .. ',' .. f.deadline .. ']'
  end
  local ended = resolved > 0 and resolved or now
  local took = 0
  if started_ms and ended >= started_ms then
    took = ended - started_ms
  end
  redis.call('HSET', bs, by, '{"primary":"' .. by .. '","primaryRun":' .. cur.run
    .. ',"rule":"' .. rule .. '","cascade":"' .. cascade .. '","protect":' .. protect
    .. ',"supersedeRunning":' .. (srun and 1 or 0) .. ',"confirm":' .. confirm
    .. ',"confidence":' .. string.format('%.17g', confidence) .. ',"parallel":' .. parallel
    .. ',"deadline":' .. cur.deadline .. ',"ended":' .. ended
    .. ',"longest":' .. took .. ',"victims":[' .. table.concat(parts, ',')
    .. '],"results":[],"probes":[]}')
  return true
end

-- 1. Keep the running set (and run start times) in step with the event's task.
if ev ~= '' then
  local cur = task(ev)
  if not cur then
    redis.call('ZREM', r, ev)
    redis.call('HDEL', rs, ev)
  else
    local hidden = live_victim(ev) or under_search(ev)
    if cur.rank == 2 and not hidden then
      redis.call('ZADD', r, cur.order, ev)
      if started > 0 then
        redis.call('HSET', rs, ev, started)
      end
    else
      redis.call('ZREM', r, ev)
    end
    if cur.rank == 3 then
      -- A run that did its work: its duration estimates what superseding saves.
      local st = redis.call('HGET', rs, ev)
      if st and cur.state ~= 'exception' and resolved > 0 and resolved >= tonumber(st) then
        redis.call('LPUSH', rd, resolved - tonumber(st))
        redis.call('LTRIM', rd, 0, 19)
      end
      redis.call('HDEL', rs, ev)
      local searched = false
      local mine = victim(ev)
      -- A run a search made (`ran`) is that search's: it starts none of its own.
      if not hidden and bisect and cur.state == 'failed' and not (mine and mine.state == 'ran') then
        searched = start_search(ev, cur, st and tonumber(st))
      end
      if not hidden and not searched then
        settle_held(ev, ev, cur.run, cur.state == 'completed' and 'supersede' or 'release', 0)
        if cur.state == 'exception' then
          release_decided(ev)
        end
      end
    end
    -- A released victim's run ended: those held for it are released in turn. The queue
    -- retries a released run, and its message announces the new pending run, not the end of
    -- the old one; the end may also arrive before the enforcer recorded the release.
    local gave = victim(ev)
    if gave and (gave.state == 'released' or (gave.state == 'settling' and gave.action == 'release'))
      and (cur.run > gave.run or (hidden and cur.rank == 3 and cur.run == gave.run)) then
      settle_held(ev, ev, gave.run, 'release', 0, gave.run)
    end
    if hidden then
      hide(ev)
    end
  end
end

-- 2. The decisions.
for _, old in ipairs(redis.call('ZRANGEBYSCORE', d, '-inf', now, 'LIMIT', 0, 256)) do
  redis.call('ZREM', p, old)
  redis.call('ZREM', w, old)
  redis.call('ZREM', d, old)
end
searching = redis.call('HLEN', bs) > 0
local pending = {}
local flat = redis.call('ZRANGE', p, 0, -1, 'WITHSCORES')
for i = 1, #flat, 2 do
  if not under_search(flat[i]) then
    pending[#pending + 1] = {id = flat[i], order = tonumber(flat[i + 1]), running = false}
  end
end
local running = {}
flat = redis.call('ZRANGE', r, 0, -1, 'WITHSCORES')
for i = 1, #flat, 2 do
  local cur = task(flat[i])
  if under_search(flat[i]) then
    -- hidden while its search needs it (its event removes it)
  elseif cur and cur.rank == 2 and cur.deadline > now then
    running[#running + 1] = {id = flat[i], order = tonumber(flat[i + 1]), running = true}
  else
    redis.call('ZREM', r, flat[i])
    redis.call('HDEL', rs, flat[i])
  end
end

local function before(a, b)
  return a.order < b.order or (a.order == b.order and id_before(a.id, b.id))
end

local function passes()
  if #pending == 0 then
    return false
  end
  if size >= 0 and #pending <= size then
    return false
  end
  if age >= 0 then
    local oldest = redis.call('ZRANGE', w, 0, 0, 'WITHSCORES')
    if not oldest[2] or now - tonumber(oldest[2]) <= age then
      return false
    end
  end
  return true
end

local function protected(id)
  if protect < 0 then
    return false
  end
  local st = redis.call('HGET', rs, id)
  -- A start we never saw could be long ago: never cancel blind.
  return st == false or now - tonumber(st) > protect
end

local decided = 0
local function decide(c, primary)
  if decided >= cap then
    return
  end
  local cur = task(c.id)
  local prim = task(primary.id)
  if not cur or not prim then
    return
  end
  local old = victim(c.id)
  if old and old.run >= cur.run and old.state ~= 'released' then
    return -- this run was decided before: at most once
  end
  if old and (old.state == 'bisecting' or old.state == 'probing') then
    return -- a bisection needs its result (it is hidden anyway)
  end
  if old then
    redis.call('ZREM', vp, old.by .. '|' .. c.id)
  end
  local action = 'supersede'
  if c.running then
    action = 'cancel'
  elseif hold then
    action = 'hold'
  end
  local why
  if strategy == 'latest-wins' then
    why = 'latest-wins: newer task ' .. primary.id .. (primary.running and ' is running' or ' is pending')
  else
    why = 'first-wins: duplicate of ' .. (primary.running and 'running ' or 'pending ') .. primary.id
  end
  if c.running then
    why = why .. '; was running'
  end
  save(c.id, {run = cur.run, by = primary.id, byrun = prim.run, at = now, rule = rule,
              state = 'decided', action = action, reason = why})
  redis.call('ZADD', vp, 0, primary.id .. '|' .. c.id)
  redis.call('ZADD', vx, cur.deadline + grace, c.id)
  hide(c.id)
  redis.call('HDEL', rs, c.id)
  emit(action, c.id, cur.run, primary.id, prim.run, why)
  redis.call('HINCRBY', m, rule .. '|decided', 1)
  decided = decided + 1
end

if (strategy == 'latest-wins' or strategy == 'first-wins') and passes() then
  local primary = nil
  if strategy == 'latest-wins' then
    for _, c in ipairs(pending) do
      if primary == nil or before(primary, c) then primary = c end
    end
    for _, c in ipairs(running) do
      if primary == nil or before(primary, c) then primary = c end
    end
  else
    for _, c in ipairs(running) do
      if primary == nil or before(c, primary) then primary = c end
    end
    if primary == nil then
      for _, c in ipairs(pending) do
        if primary == nil or before(c, primary) then primary = c end
      end
    end
  end
  for _, c in ipairs(pending) do
    if c.id ~= primary.id and (strategy == 'first-wins' or before(c, primary)) then
      decide(c, primary)
    end
  end
  if srun then
    for _, c in ipairs(running) do
      local loses = (strategy == 'first-wins' and before(primary, c))
        or (strategy == 'latest-wins' and before(c, primary))
      if c.id ~= primary.id and loses and not protected(c.id) then
        decide(c, primary)
      end
    end
  end
end

-- Nothing here outlives the index's own data for the key.
local ttl = redis.call('PTTL', t)
if ttl > 0 then
  for i = 6, #KEYS do
    local cur_ttl = redis.call('PTTL', KEYS[i])
    if cur_ttl ~= -2 and cur_ttl < ttl then
      redis.call('PEXPIRE', KEYS[i], ttl)
    end
  end
end
return {decided, redis.call('XLEN', o) + redis.call('ZCARD', h) + redis.call('HLEN', bs)}
