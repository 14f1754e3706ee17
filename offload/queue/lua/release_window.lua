-- Release up to `limit` held jobs whose cap window is earlier than the store's current one (held jobs are scored by
-- their window, so this is one range read). Callers repeat until it answers fewer than `limit`, so a big backlog
-- moves in small steps that never block Redis for long. The window is the store's UTC day (`window_of` in
-- clock.lua), never a caller's: the reply tells a caller which window it is and when the next one begins, so a
-- worker whose own clock is a day off still releases at the store's midnight and only then.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, limit
-- Returns: {the number released, the current window (digits, e.g. 20261130), ms until the next window begins}
--- @include "clock"
--- @include "records"
--- @include "ready"
local now = now_ms(ARGV[1])
local limit = tonumber(ARGV[2])
local window = window_of(now)
local due = redis.call('ZRANGEBYSCORE', P .. 'held', '-inf', '(' .. window, 'LIMIT', 0, limit)
if #due > 0 then
  bulk('ZREM', P .. 'held', due)
  local live = {}
  for _, id in ipairs(due) do
    if redis.call('EXISTS', jkey(id)) == 1 then live[#live + 1] = id end
  end
  make_ready(live, now, true)
end
return {#due, window, window_left(now)}
