-- A backend's global request rate (GCRA) shared by every worker on every machine, and the cool-down one
-- worker's 429 imposes on all of them. Callers sleep the wait on their own, so a limited backend never blocks
-- a worker's other jobs.
-- KEYS: [1] the backend's GCRA state, [2] its cool-down key (offload.queue.keyspace.backend_rate, backend_cooldown)
-- ARGV: [1] ms between requests (0: only the cool-down is read), [2] burst
-- Returns: ms to wait: positive = a slot is reserved, go after the wait; negative = the backend is cooling
--   down, ask again after the wait
--- @include "clock"
--- @include "cooldown"
local now = now_ms('')
local cool = cooling(KEYS[2], now)
if cool > 0 then return -cool end
local interval, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
if interval <= 0 then return 0 end
-- the state is "<theoretical arrival time> <now when written>": a step back of the store's clock since the last
-- write moves the arrival time back with it, or every caller would wait for the clock to catch up
local tat, at = string.match(redis.call('GET', KEYS[1]) or '', '^(%S+) ?(%S*)$')
tat, at = tonumber(tat) or now, tonumber(at)
if at and now < at - 1000 then tat = tat - (at - now) end
if tat < now then tat = now end
local wait = tat - now - (burst - 1) * interval
if wait < 0 then wait = 0 end
redis.call('SET', KEYS[1], string.format('%.0f %.0f', tat + interval, now), 'PX',
  math.ceil(tat + interval - now) + 1000)
return math.ceil(wait)
