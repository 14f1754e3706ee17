-- A routed backend's health, shared by every worker on every machine (offload/queue/backend_health.py). Closed:
-- calls go. Open: it cools down (its cool-down key, the one a 429 sets, is live) and the router skips it. Once the
-- cool-down ran out it half-opens: one probe job may go (`probe`), the rest skip it until the probe's answer or
-- the probe's lease ends; a success closes it, a failure opens it again for the next, longer cool-down.
-- KEYS: [1] the backend's health hash, [2] its cool-down key (offload.queue.keyspace.backend_health, backend_cooldown)
-- ARGV: [1] op: read, probe, fail or ok; [2] now ('': the store's clock); then per op:
--   probe: [3] the probe's lease ms
--   fail: [3] errors that open it, [4] their window ms, [5] the cool-down ms per opening in a row, space-separated
--     (the last repeats), [6] the provider's Retry-After ms ('' none: a longer one wins)
--   ok: [3] the run's ms ('' unknown), folded into the measured mean run time; [4] its queue delay ms (submit to
--     the provider starting it; '' unknown), folded into the measured mean queue delay
-- Returns: {state (closed, open, half), cool-down ms left, mean run ms ('' unknown), granted (probe: 1 when this
--   caller may send; fail: 1 when this error opened it), mean queue delay ms ('' unknown), the store's now ms}
--- @include "clock"
--- @include "cooldown"
local op, now = ARGV[1], now_ms(ARGV[2])
local h = KEYS[1]
local state, probe_until, fails, win, strikes, mean, queued =
  unpack(redis.call('HMGET', h, 'state', 'probe_until', 'fails', 'win', 'strikes', 'mean_ms', 'queue_ms'))
state = state or 'closed'
strikes = tonumber(strikes or '0')
local cool = cooling(KEYS[2], now)
local granted = 0
local function open_for(retry_ms)
  strikes = strikes + 1
  local steps = {}
  for v in string.gmatch(ARGV[5], '%S+') do steps[#steps + 1] = tonumber(v) end
  local ms = math.max(steps[math.min(strikes, #steps)], tonumber(retry_ms) or 0)
  cool = cool_for(KEYS[2], now, ms)
  state = 'open'
  redis.call('HSET', h, 'state', 'open', 'strikes', strikes, 'fails', 0, 'win', now)
  redis.call('HDEL', h, 'probe_until')
end
if op == 'probe' then
  local free = state == 'open' or (state == 'half' and tonumber(probe_until or '0') <= now)
  if cool > 0 then
    granted = 0
  elseif state == 'closed' then
    granted = 1
  elseif free then
    state = 'half'
    redis.call('HSET', h, 'state', 'half', 'probe_until', now + tonumber(ARGV[3]))
    granted = 1
  end
elseif op == 'fail' then
  if state == 'half' or (state == 'open' and cool == 0) then
    open_for(ARGV[6])  -- the probe failed: a longer cool-down
    granted = 1
  elseif state == 'open' then
    if tonumber(ARGV[6]) then cool = cool_for(KEYS[2], now, tonumber(ARGV[6])) end  -- a call sent before it opened
  else
    local n = tonumber(fails or '0')
    if now - tonumber(win or '0') > tonumber(ARGV[4]) then
      n = 0
      redis.call('HSET', h, 'win', now)
    end
    n = n + 1
    if n >= tonumber(ARGV[3]) then
      strikes = 0
      open_for(ARGV[6])
      granted = 1
    else
      redis.call('HSET', h, 'fails', n)
    end
  end
elseif op == 'ok' then
  if state == 'half' then
    state = 'closed'
    redis.call('HSET', h, 'state', 'closed', 'strikes', 0, 'fails', 0, 'win', now)
    redis.call('HDEL', h, 'probe_until')
  end
  -- moving means of the last ~20 runs: the price model of `route: cheapest` and a deadline's expected finish
  local function fold(field, counter, value, old)
    local n = tonumber(redis.call('HINCRBY', h, counter, 1))
    local m = (tonumber(old or '') or value) + (value - (tonumber(old or '') or value)) / math.min(n, 20)
    redis.call('HSET', h, field, string.format('%.0f', m))
    return m
  end
  local run, wait = tonumber(ARGV[3] or ''), tonumber(ARGV[4] or '')
  if run then mean = fold('mean_ms', 'runs', run, mean) end
  if wait then queued = fold('queue_ms', 'queued', math.max(wait, 0), queued) end
end
if state == 'half' and tonumber(probe_until or '0') <= now and op ~= 'probe' then state = 'open' end
local function ms(v) return v and string.format('%.0f', tonumber(v)) or '' end
return {state, cool, ms(mean), granted, ms(queued), now}
