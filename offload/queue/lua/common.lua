-- Shared prelude, prepended to every script. KEYS[1] is the queue's key prefix, e.g. "offload:{gpu}:",
-- so every key a script touches carries the queue's hash tag and lives in one cluster slot.
-- Hot paths batch their set updates (one ZADD/SREM for many jobs) and write each job hash once: the cost
-- of a script is mostly the number of redis.call()s it makes.
local P = KEYS[1]
local QUEUE = string.match(P, '{(.-)}')
local EVENTS_MAX = __EVENTS_MAX__
local PRIO_SPAN = 1000000000000  -- 1e12 sequence numbers per priority level
local CHUNK = 500

local function now_ms(arg)
  if arg ~= nil and arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function jkey(id) return P .. 'job:' .. id end

local function fmt(n) return string.format('%.0f', n) end

-- One stream entry per transition batch: {state, space-separated job ids}.
local function event(ids, state)
  if #ids == 0 then return end
  redis.call('XADD', P .. 'events', 'MAXLEN', '~', EVENTS_MAX, '*', 'state', state, 'jobs',
    table.concat(ids, ' '))
end

-- cmd key m1 [m2 ...] in chunks, so thousands of members cost a handful of calls.
local function bulk(cmd, key, members)
  for i = 1, #members, CHUNK do
    redis.call(cmd, key, unpack(members, i, math.min(i + CHUNK - 1, #members)))
  end
end

-- ZADD key s1 m1 s2 m2 ... from a flat {score, member, ...} list.
local function bulk_zadd(key, pairs)
  for i = 1, #pairs, 2 * CHUNK do
    redis.call('ZADD', key, unpack(pairs, i, math.min(i + 2 * CHUNK - 1, #pairs)))
  end
end

local function count(field, n)
  if n > 0 then redis.call('HINCRBY', P .. 'stats', field, n) end
end

-- Latency histograms for /metrics (ms values into fixed buckets, one hash per queue): kept in Redis so
-- every server process reports the same numbers. One HINCRBY per distinct bucket per batch.
local HIST_BUCKETS = {__HIST_BUCKETS__}
local function observe(name, values)
  if #values == 0 then return end
  local counts, sum = {}, 0
  for _, v in ipairs(values) do
    if v < 0 then v = 0 end
    sum = sum + v
    local i = #HIST_BUCKETS + 1
    for j, b in ipairs(HIST_BUCKETS) do
      if v <= b then i = j; break end
    end
    counts[i] = (counts[i] or 0) + 1
  end
  for i, c in pairs(counts) do redis.call('HINCRBY', P .. 'hist', name .. ':' .. i, c) end
  redis.call('HINCRBY', P .. 'hist', name .. ':count', #values)
  redis.call('HINCRBY', P .. 'hist', name .. ':sum', fmt(sum))
end

-- Put jobs into the ready set. A fresh score puts a job behind everything of its priority; a reaped job
-- keeps its old score so it is resumed before newer work.
local function make_ready(ids, now, fresh)
  if #ids == 0 then return end
  local zs = {}
  local seq = 0
  if fresh then seq = redis.call('INCRBY', P .. 'seq', #ids) - #ids end
  for _, id in ipairs(ids) do
    local k = jkey(id)
    local score
    if fresh then
      seq = seq + 1
      score = fmt((1000 - tonumber(redis.call('HGET', k, 'priority') or 0)) * PRIO_SPAN + seq)
      redis.call('HSET', k, 'state', 'queued', 'score', score, 'ready_at', now, 'owner', '', 'token', '')
    else
      score = redis.call('HGET', k, 'score')  -- and its old ready time: it has been waiting since then
      redis.call('HSET', k, 'state', 'queued', 'owner', '', 'token', '')
    end
    zs[#zs + 1] = score
    zs[#zs + 1] = id
  end
  bulk_zadd(P .. 'ready', zs)
  event(ids, 'queued')
end

-- Leave the active set: forget the leases everywhere they are indexed. owners: id -> owner.
local function unlease(ids, owners)
  if #ids == 0 then return end
  bulk('ZREM', P .. 'active', ids)
  if redis.call('SCARD', P .. 'submitted') > 0 then bulk('SREM', P .. 'submitted', ids) end
  if redis.call('SCARD', P .. 'cancelreq') > 0 then bulk('SREM', P .. 'cancelreq', ids) end
  local by_owner = {}
  for _, id in ipairs(ids) do
    local o = owners[id]
    if o and o ~= '' then
      by_owner[o] = by_owner[o] or {}
      table.insert(by_owner[o], id)
    end
  end
  for o, list in pairs(by_owner) do bulk('SREM', P .. 'owned:' .. o, list) end
end

-- Enter a terminal state. The terminal set is scored by the time the record expires (finish + retention;
-- retention 0 keeps it for a century), and the reaper deletes expired records in bulk, which keeps an
-- EXPIRE per job off the hot path. `extra` is an optional flat list of more fields to set on every job.
local function finish(ids, state, now, err, retentions, extra)
  if #ids == 0 then return end
  local zs = {}
  for i, id in ipairs(ids) do
    local k = jkey(id)
    local fields = {'state', state, 'finished_at', now, 'owner', ''}  -- token kept: repeats are recognised
    if err then fields[#fields + 1] = 'error'; fields[#fields + 1] = err end
    if extra and extra[i] then
      for _, v in ipairs(extra[i]) do fields[#fields + 1] = v end
    end
    redis.call('HSET', k, unpack(fields))
    local ret = tonumber((retentions and retentions[i]) or redis.call('HGET', k, 'retention') or '0') or 0
    if ret <= 0 then ret = 3153600000 end
    zs[#zs + 1] = fmt(now + ret * 1000)
    zs[#zs + 1] = id
  end
  bulk_zadd(P .. state, zs)
  count(state, #ids)
  event(ids, state)
end

local function promote(now, limit)
  local moved = 0
  for _, set in ipairs({'delayed', 'retry'}) do
    local due = redis.call('ZRANGEBYSCORE', P .. set, '-inf', now, 'LIMIT', 0, limit)
    if #due > 0 then
      bulk('ZREM', P .. set, due)
      local live = {}
      for _, id in ipairs(due) do
        if redis.call('EXISTS', jkey(id)) == 1 then live[#live + 1] = id end
      end
      make_ready(live, now, true)
      moved = moved + #live
    end
  end
  return moved
end

-- Leases that ended without a verdict (worker died or let go). The remote id is kept so the next worker
-- resumes polling; only a crash (counted=true) uses up one of the job's lease expiries.
local function return_leases(ids, now, counted)
  local back, dead, cancelled, leaving, owners = {}, {}, {}, {}, {}
  for _, id in ipairs(ids) do
    local k = jkey(id)
    local f = redis.call('HMGET', k, 'state', 'owner', 'expiries', 'max_attempts', 'cancel', 'remote_id',
      'attempts')
    if not f[1] then
      leaving[#leaving + 1] = id
    elseif f[1] == 'active' or f[1] == 'submitted' then
      leaving[#leaving + 1] = id
      owners[id] = f[2]
      local attempts = tonumber(f[7] or 0) - 1
      local exp = tonumber(f[3] or 0)
      if counted then exp = exp + 1 end
      redis.call('HSET', k, 'attempts', attempts, 'expiries', exp)
      if f[5] == '1' and (not f[6] or f[6] == '') then
        cancelled[#cancelled + 1] = id
      elseif exp > tonumber(f[4]) then
        redis.call('HSET', k, 'attempts', attempts + 1)
        dead[#dead + 1] = id
      else
        back[#back + 1] = id
      end
    end
  end
  unlease(leaving, owners)
  finish(cancelled, 'cancelled', now, nil, nil)
  finish(dead, 'dead', now, 'lease expired', nil)
  make_ready(back, now, false)
  return #leaving
end

local function reap(now, limit)
  local n = 0
  local gone = redis.call('ZRANGEBYSCORE', P .. 'workers', '-inf', now, 'LIMIT', 0, limit)
  for _, wid in ipairs(gone) do
    local ids = redis.call('SMEMBERS', P .. 'owned:' .. wid)
    n = n + return_leases(ids, now, true)
    if #ids > 0 then  -- remembered a day: if the worker's machine was pre-empted, `forgive` refunds the expiries
      for _, id in ipairs(ids) do redis.call('HINCRBY', P .. 'lost:' .. wid, id, 1) end
      redis.call('EXPIRE', P .. 'lost:' .. wid, 86400)
    end
    redis.call('DEL', P .. 'owned:' .. wid)
    redis.call('ZREM', P .. 'workers', wid)
  end
  return n
end

-- Delete the records of finished jobs whose retention ran out (terminal sets are scored by expiry time).
local function trim(now, limit)
  local trimmed = 0
  for _, set in ipairs({'succeeded', 'dead', 'cancelled'}) do
    local expired = redis.call('ZRANGEBYSCORE', P .. set, '-inf', now, 'LIMIT', 0, limit)
    if #expired > 0 then
      bulk('ZREM', P .. set, expired)
      local keys = {}
      for _, id in ipairs(expired) do keys[#keys + 1] = jkey(id) end
      for j = 1, #keys, CHUNK do redis.call('DEL', unpack(keys, j, math.min(j + CHUNK - 1, #keys))) end
      trimmed = trimmed + #expired
    end
  end
  return trimmed
end

-- Check that `token` still owns job `id`; returns {state, owner, retention, started_at} or nil and an error word.
local function owned(id, token)
  local f = redis.call('HMGET', jkey(id), 'state', 'token', 'owner', 'retention', 'started_at')
  if not f[1] then return nil, 'NOTFOUND' end
  if f[2] ~= token or (f[1] ~= 'active' and f[1] ~= 'submitted') then return nil, 'STALE' end
  return {f[1], f[3], f[4], f[5]}, nil
end
