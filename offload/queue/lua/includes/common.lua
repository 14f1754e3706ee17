-- Shared prelude of the queue scripts, put in where a script includes "common" (offload/queue/scripts.py).
-- KEYS[1] is the queue's key prefix, e.g. "offload:{gpu}:",
-- so every key a script touches carries the queue's hash tag and lives in one cluster slot.
-- Hot paths batch their set updates (one ZADD/SREM for many jobs) and write each job hash once: the cost
-- of a script is mostly the number of redis.call()s it makes. In a per-job loop, the Lua around those calls
-- counts too: append with a running count, not `t[#t + 1]` (`#` is a search each time in Lua 5.1), and pass a
-- job's fields to HSET as arguments instead of building a table to unpack. Done in claim, complete and finish,
-- that cut the Valkey time per job of a worker's no-op job from ~51 to ~45 µs (commandstats over 50,000 jobs of
-- bench/worker_throughput.py's worker, two interleaved pairs).
-- Every script is safe to run twice with the same arguments (a reply lost on the way back, then the client
-- sending the command again, as cluster clients do on their own): the second run changes nothing more.
-- ARGV[1] of every queue script is `now`, in ms ('' = the server's clock, TIME): tests run on a virtual clock.
local P = KEYS[1]
local QUEUE = string.match(P, '{(.-)}')
local EVENTS_MAX = __EVENTS_MAX__
local EVENT_IDS = 100  -- job ids per stream entry: an entry (and so the capped stream) stays bounded
local PRIO_SPAN = 1000000000000  -- 1e12 sequence numbers per priority level
local CHUNK = 500
local CENTURY_S = 3153600000
local TERMINAL = {succeeded = true, dead = true, cancelled = true}  -- states a job never leaves
local NONE = {}  -- nothing to unpack

--- @include "clock"

local function jkey(id) return P .. 'job:' .. id end

local function fmt(n) return string.format('%.0f', n) end

-- Stream entries {state, space-separated job ids}, at most EVENT_IDS ids each.
local function event(ids, state)
  for i = 1, #ids, EVENT_IDS do
    redis.call('XADD', P .. 'events', 'MAXLEN', '~', EVENTS_MAX, '*', 'state', state, 'jobs',
      table.concat(ids, ' ', i, math.min(i + EVENT_IDS - 1, #ids)))
  end
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

-- `seen` is the latest clock reading a worker-side script saw, in ms, and after it, when there is one, the steps
-- back of the clock (`shift_back`) not yet told to a worker or the server: "<ms>" or "<ms> <ms stepped back>".
local CLOCK_STEP_MS = 1000
local function seen_parts(raw)
  if not raw then return nil, 0 end
  local at, pending = string.match(raw, '^(%S+) ?(%S*)$')
  return tonumber(at), tonumber(pending) or 0
end

-- The mirror of `stamp`'s excuse: a step back of the store's clock (an NTP step, a restored VM, a failover to a
-- host whose clock is behind) would leave every time already scheduled relative to it (a worker's lease deadline, a
-- retry's backoff, a producer's `delay`) that much later, so a crashed worker's jobs and every retry would wait for
-- the clock to catch up. A reading more than CLOCK_STEP_MS before `seen` is a step back, and those times move back
-- by it, once: the step as seen, less whatever time passed unread before it (nothing moves earlier than it was
-- meant). Every script that schedules such a time (claim and heartbeat a deadline, fail a retry, enqueue a delay)
-- and the maintenance pass check first, so nothing scheduled on the new clock is moved again. A `run_at` the
-- producer gave is a time of day and stays. Held jobs waiting out a window the clock has not reached yet are
-- released (the caps of the window it is in decide them again). Only the store's own clock steps: a caller's `now`
-- (a test's virtual time) is never taken for one. Recorded in the events stream and Valkey's log.
local function shift_back(step, now)
  local moved = 0
  for _, set in ipairs({'workers', 'retry', 'delayed'}) do
    local zs, no = {}, 0
    local members = redis.call('ZRANGE', P .. set, 0, -1, 'WITHSCORES')
    for i = 1, #members, 2 do
      local id, at = members[i], fmt(tonumber(members[i + 1]) - step)
      if set == 'workers' or set == 'retry' or redis.call('HEXISTS', jkey(id), 'delay') == 1 then
        zs[no + 1], zs[no + 2], no = at, id, no + 2
        if set ~= 'workers' then redis.call('HSET', jkey(id), 'run_at', at) end
      end
    end
    bulk_zadd(P .. set, zs)
    if set ~= 'workers' then moved = moved + no / 2 end
  end
  local ahead = redis.call('ZRANGEBYSCORE', P .. 'held', '(' .. window_of(now), '+inf')
  local zs = {}
  for i, id in ipairs(ahead) do zs[2 * i - 1], zs[2 * i] = 0, id end
  bulk_zadd(P .. 'held', zs)
  redis.call('XADD', P .. 'events', 'MAXLEN', '~', EVENTS_MAX, '*', 'state', 'clock_stepped_back', 'jobs', '',
    'step_ms', fmt(step), 'moved', moved, 'released', #ahead)
  redis.log(redis.LOG_WARNING, 'offload queue ' .. QUEUE .. ': the clock stepped back ' .. fmt(step) .. ' ms; ' ..
    moved .. ' retry/delay times and the worker deadlines moved back with it, ' .. #ahead .. ' held jobs released')
end

-- `shift_back` for the scripts that schedule a time without stamping (fail, enqueue): one read of `seen`.
local function rewind(now)
  if ARGV[1] ~= '' then return end
  local seen, pending = seen_parts(redis.call('GET', P .. 'seen'))
  if not seen or seen - now <= CLOCK_STEP_MS then return end
  shift_back(seen - now, now)
  redis.call('SET', P .. 'seen', fmt(now) .. ' ' .. fmt(pending + seen - now))
end

-- An outage costs no job a lease expiry. The worker-side scripts (claim, heartbeat, reap) stamp the time
-- they ran; live workers and the server's maintenance run one at least every heartbeat interval. A longer
-- silence than `silence` ms means nobody could reach Redis (it was down, restarting or cut off), so the
-- workers that were alive when it began cannot have been heard either: their lease deadlines move on by
-- the length of the silence, as if it had not happened. Once per worker until it is heard from again
-- (`heard`): a worker that died meanwhile is reaped one silence later than otherwise, and then counted, and
-- a queue whose workers speak less often than `silence` cannot postpone a dead worker's reaping forever.
-- A step back of the clock is taken here too (`shift_back`): with `report` (heartbeat, reap) the steps back not
-- yet told are returned, for the caller to log, and forgotten; otherwise kept in `seen` for the next of those.
-- Returns the silence excused (ms, 0 when none) and the steps back to report (ms).
local function stamp(now, silence, report)
  local seen, pending = seen_parts(redis.call('SET', P .. 'seen', fmt(now), 'GET'))
  if seen and seen - now > CLOCK_STEP_MS and ARGV[1] == '' then
    shift_back(seen - now, now)
    pending, seen = pending + seen - now, now
  end
  local behind = seen and now < seen  -- a clock behind (a caller's, or within CLOCK_STEP_MS): keep the later
  if behind or (pending > 0 and not report) then
    local kept = fmt(behind and seen or now)
    if pending > 0 and not report then kept = kept .. ' ' .. fmt(pending) end
    redis.call('SET', P .. 'seen', kept)
  end
  if not report then pending = 0 end
  if not seen or not silence or silence <= 0 or now - seen <= silence then return 0, pending end
  local gap = now - seen
  local live = redis.call('ZRANGEBYSCORE', P .. 'workers', '(' .. fmt(seen), '+inf', 'WITHSCORES')
  local zs, excused = {}, {}
  for i = 1, #live, 2 do
    if redis.call('SISMEMBER', P .. 'excused', live[i]) == 0 then
      zs[#zs + 1] = fmt(tonumber(live[i + 1]) + gap)
      zs[#zs + 1] = live[i]
      excused[#excused + 1] = live[i]
    end
  end
  bulk_zadd(P .. 'workers', zs)
  bulk('SADD', P .. 'excused', excused)
  return gap, pending
end

-- A worker speaks (claim, heartbeat): its lease runs from now, and it may be excused an outage again.
local function heard(wid, now, lease)
  redis.call('ZADD', P .. 'workers', now + lease, wid)
  redis.call('SREM', P .. 'excused', wid)
end

-- Jobs became ready: if a claim found the ready set empty since the last wake (it set `idle`), tell the idle
-- workers at once (they wait on `wake` instead of their next poll, up to 0.5 s away). One message per idle
-- spell, not one per job: a queue whose workers are busy costs a DEL per call and nothing more.
local function wake()
  if redis.call('DEL', P .. 'idle') == 1 then redis.call('PUBLISH', P .. 'wake', '') end
end

-- A job whose cancel waits for its remote job to be cancelled (cancel.lua: a remote job may still run, and is
-- paid while it does) goes ahead of every priority, in a level of its own below 0 (its sequence number kept, so
-- these stay in order too): the next claim cancels it, whatever the backlog.
local function cancel_first(score) return fmt(tonumber(score) % PRIO_SPAN - PRIO_SPAN) end

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
      local g = redis.call('HMGET', k, 'priority', 'cancel')
      score = fmt((1000 - tonumber(g[1] or 0)) * PRIO_SPAN + seq)
      if g[2] == '1' then score = cancel_first(score) end
      redis.call('HSET', k, 'state', 'queued', 'score', score, 'ready_at', now, 'owner', '', 'token', '')
    else
      local g = redis.call('HMGET', k, 'score', 'cancel')  -- and its old ready time: it has been waiting since then
      score = g[2] == '1' and cancel_first(g[1]) or g[1]
      redis.call('HSET', k, 'state', 'queued', 'owner', '', 'token', '')
    end
    zs[#zs + 1] = score
    zs[#zs + 1] = id
  end
  bulk_zadd(P .. 'ready', zs)
  event(ids, 'queued')
  wake()
end

-- Leave the active set: forget the leases everywhere they are indexed. owners: id -> owner. A worker's
-- leases are a sorted set scored by the lease's sequence number (the number in its token).
local function unlease(ids, owners)
  if #ids == 0 then return end
  bulk('ZREM', P .. 'active', ids)
  if redis.call('SCARD', P .. 'submitted') > 0 then bulk('SREM', P .. 'submitted', ids) end
  if redis.call('SCARD', P .. 'cancelreq') > 0 then bulk('SREM', P .. 'cancelreq', ids) end
  local by_owner, counts = {}, {}
  for _, id in ipairs(ids) do
    local o = owners[id]
    if o and o ~= '' then
      local c = (counts[o] or 0) + 1
      if c == 1 then by_owner[o] = {} end
      by_owner[o][c] = id
      counts[o] = c
    end
  end
  for o, list in pairs(by_owner) do bulk('ZREM', P .. 'owned:' .. o, list) end
end

-- The idempotency key of a job lives as long as the job is not finished (a job may wait for days: a
-- run_at far ahead, a long backlog), then as long as its record is kept, and at least a day.
local function idem_expire(idem, ret)
  if idem and idem ~= '' then
    redis.call('EXPIRE', P .. 'idem:' .. idem, math.max(ret, 86400))
  end
end

-- Enter a terminal state. The terminal set is scored by the time the record expires (finish + retention;
-- retention 0 keeps it for a century), and the reaper deletes expired records in bulk, which keeps an
-- EXPIRE per job off the hot path. `infos[i]` is {retention, idempotency key} when the caller read them
-- already; `extra` an optional flat list of more fields to set on every job.
local function finish(ids, state, now, err, infos, extra)
  if #ids == 0 then return end
  local zs, expiry = {}, {}  -- expiry: the terminal score by retention (a batch mostly shares one)
  for i, id in ipairs(ids) do
    local k = jkey(id)
    local more = extra and extra[i] or NONE  -- the fields are passed as they are: no table built per job
    if err then  -- the token is kept: repeats are recognised
      redis.call('HSET', k, 'state', state, 'finished_at', now, 'owner', '', 'error', err, unpack(more))
    else
      redis.call('HSET', k, 'state', state, 'finished_at', now, 'owner', '', unpack(more))
    end
    local info = infos and infos[i] or redis.call('HMGET', k, 'retention', 'idem')
    local ret = tonumber(info[1] or '0') or 0
    if ret <= 0 then ret = CENTURY_S end
    idem_expire(info[2], ret)
    local at = expiry[ret]
    if not at then
      at = fmt(now + ret * 1000)
      expiry[ret] = at
    end
    zs[2 * i - 1] = at
    zs[2 * i] = id
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
-- resumes polling; only a crash (counted=true) uses up one of the job's lease expiries. A remote id that a
-- `start` webhook recorded while this lease held the job (hook.lua's STARTED, `started_n`) and that the
-- worker never checkpointed itself (still `active`) was learnt from the provider alone: counted as adopted.
-- A cancelled job ends here only when nothing remote may run (no remote id, no intent left open); else it
-- goes back first in line, for the next worker to cancel the remote job (see cancel.lua).
local function return_leases(ids, now, counted)
  local back, dead, cancelled, leaving, owners = {}, {}, {}, {}, {}
  for _, id in ipairs(ids) do
    local k = jkey(id)
    local f = redis.call('HMGET', k, 'state', 'owner', 'expiries', 'max_attempts', 'cancel', 'remote_id',
      'attempts', 'started_n', 'sub_open')
    if not f[1] then
      leaving[#leaving + 1] = id
    elseif f[1] == 'active' or f[1] == 'submitted' then
      leaving[#leaving + 1] = id
      owners[id] = f[2]
      if f[8] then
        redis.call('HDEL', k, 'started_n')
        if f[1] == 'active' then
          redis.call('HINCRBY', k, 'adopted', 1)
          count('adopted', 1)
        end
      end
      local attempts = tonumber(f[7] or 0) - 1
      local exp = tonumber(f[3] or 0)
      if counted then exp = exp + 1 end
      redis.call('HSET', k, 'attempts', attempts, 'expiries', exp)
      if f[5] == '1' and (not f[6] or f[6] == '') and f[9] ~= '1' then
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

-- A worker that is gone: its leases (and the memory of its last claim) go.
local function forget_worker(wid)
  redis.call('DEL', P .. 'owned:' .. wid, P .. 'lastclaim:' .. wid)
  redis.call('ZREM', P .. 'workers', wid)
  redis.call('SREM', P .. 'excused', wid)
end

local function reap(now, limit)
  local n = 0
  local gone = redis.call('ZRANGEBYSCORE', P .. 'workers', '-inf', now, 'LIMIT', 0, limit)
  for _, wid in ipairs(gone) do
    local ids = redis.call('ZRANGE', P .. 'owned:' .. wid, 0, -1)
    n = n + return_leases(ids, now, true)
    if #ids > 0 then  -- remembered a day: if the worker's machine was pre-empted, `forgive` refunds the expiries
      for _, id in ipairs(ids) do redis.call('HINCRBY', P .. 'lost:' .. wid, id, 1) end
      redis.call('EXPIRE', P .. 'lost:' .. wid, 86400)
    end
    forget_worker(wid)
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

-- The submission number a job is sent under when no intent of it is open (begin.lua, and claim.lua's `begin`):
-- 1 for the first; the next after a run whose remote id was recorded (`remote_n` = `sub_n`); else the same
-- number again (the last try was answered without a remote job: the same run is still wanted).
local function next_submission(sub_n, remote_n)
  local sub = tonumber(sub_n or '')
  if not sub then return 1 end
  if tonumber(remote_n or '') == sub then return sub + 1 end
  return sub
end

-- Check that `token` still owns job `id`: returns {state, owner, retention, started_at, idem} or nil
-- and an error word.
local function owned(id, token)
  local f = redis.call('HMGET', jkey(id), 'state', 'token', 'owner', 'retention', 'started_at', 'idem')
  if not f[1] then return nil, 'NOTFOUND' end
  if f[2] ~= token or (f[1] ~= 'active' and f[1] ~= 'submitted') then return nil, 'STALE' end
  return {f[1], f[3], f[4], f[5], f[6]}, nil
end

-- Held jobs are scored by the numeric cap window they wait out (20261130), so the jobs due for release
-- are one range query, and a big backlog held today costs nothing to skip.
local function hold_job(id, owner, now, reason, window)
  local k = jkey(id)
  unlease({id}, {[id] = owner})
  redis.call('HINCRBY', k, 'attempts', -1)
  redis.call('HSET', k, 'state', 'held', 'error', reason, 'held_at', now, 'owner', '', 'token', '',
    'held_window', window or '')
  redis.call('ZADD', P .. 'held', tonumber(window) or 0, id)
  event({id}, 'held')
end

-- The cap counters of one window: jobs submitted (each job once per window: the `counted` set) and spend
-- reserved (each submission's worst-case cost, settled to the real cost when it is known).
local function cap_base(window) return P .. 'cap:' .. window .. ':' end

local function cap_open(window)
  local base = cap_base(window)
  return {base = base, jobs = tonumber(redis.call('GET', base .. 'jobs') or '0'),
          spend = tonumber(redis.call('GET', base .. 'spend') or '0'), new_jobs = 0, new_spend = 0}
end

-- Decide one submission against the caps, in order, as if reserved one by one. A job counted in the window
-- already passes the job cap; its spend is reserved again only for a new submission (`spend_again`).
-- Returns nil (reserved) or the cap that says no ('jobs' or 'spend').
local function cap_take(st, id, estimate, job_cap, spend_cap, spend_again)
  local counted = redis.call('SISMEMBER', st.base .. 'counted', id) == 1
  if counted and not spend_again then return nil end
  if job_cap and not counted and st.jobs >= job_cap then return 'jobs' end
  if spend_cap and st.spend + estimate > spend_cap then return 'spend' end
  if not counted then
    redis.call('SADD', st.base .. 'counted', id)
    st.jobs = st.jobs + 1
    st.new_jobs = st.new_jobs + 1
  end
  st.spend = st.spend + estimate
  st.new_spend = st.new_spend + estimate
  return nil
end

local function cap_commit(st)
  if st.new_jobs > 0 then redis.call('INCRBY', st.base .. 'jobs', st.new_jobs) end
  if st.new_spend ~= 0 then redis.call('INCRBYFLOAT', st.base .. 'spend', st.new_spend) end
  if st.new_jobs > 0 or st.new_spend ~= 0 then
    for _, k in ipairs({'jobs', 'counted', 'spend'}) do redis.call('EXPIRE', st.base .. k, 259200) end
  end
end

-- Which cap a fresh submission with this estimated cost would exceed now, or nil.
local function cap_reached(window, job_cap, spend_cap, estimate)
  if window == '' or (not job_cap and not spend_cap) then return nil end
  local base = cap_base(window)
  if job_cap and tonumber(redis.call('GET', base .. 'jobs') or '0') >= job_cap then return 'jobs' end
  if spend_cap and tonumber(redis.call('GET', base .. 'spend') or '0') + estimate > spend_cap then
    return 'spend'
  end
  return nil
end

-- The real cost of a job's current submission replaces its reservation in the window it was reserved in.
-- `cost` nil: unknown, the reservation stands (it was the worst case). `refund`: nothing was started (the
-- provider refused the request), so the job is not counted either.
local function settle(k, id, cost, refund)
  local g = redis.call('HMGET', k, 'resv', 'resv_w')
  if g[2] and g[2] ~= '' then
    local base = cap_base(g[2])
    local delta = nil
    if refund then
      delta = -tonumber(g[1] or '0')
      if redis.call('SREM', base .. 'counted', id) == 1 then redis.call('DECRBY', base .. 'jobs', 1) end
    elseif cost and g[1] then
      delta = cost - tonumber(g[1])
    end
    if delta and delta ~= 0 then redis.call('INCRBYFLOAT', base .. 'spend', delta) end
    if refund then
      redis.call('HDEL', k, 'resv', 'resv_w', 'resv_n')
    elseif delta then
      redis.call('HDEL', k, 'resv')
    end
  end
end
