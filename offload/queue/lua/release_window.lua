-- Release up to `limit` held jobs whose cap window is earlier than `window` (held jobs are scored by their
-- window, so this is one range read). Callers repeat until it answers fewer than `limit`, so a big backlog moves
-- in small steps that never block Redis for long.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keys.py)
-- ARGV: now, window (digits, e.g. 20261130), limit
-- Returns: the number released
--- @include "common"
local now = now_ms(ARGV[1])
local window, limit = ARGV[2], tonumber(ARGV[3])
local due = redis.call('ZRANGEBYSCORE', P .. 'held', '-inf', '(' .. window, 'LIMIT', 0, limit)
if #due > 0 then
  bulk('ZREM', P .. 'held', due)
  local live = {}
  for _, id in ipairs(due) do
    if redis.call('EXISTS', jkey(id)) == 1 then live[#live + 1] = id end
  end
  make_ready(live, now, true)
end
return #due
