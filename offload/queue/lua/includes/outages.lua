-- The store's clock as the worker-side scripts read it: an outage (nobody heard for longer than a silence) excused,
-- and a step back of the clock undone for every time already scheduled on it.
--- @include "records"
--- @include "events"
--- @include "clock"

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
