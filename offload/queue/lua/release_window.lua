-- ARGV: now, window, limit. Release held jobs whose cap window is earlier than `window` (windows compare as
-- strings, e.g. 20261129 < 20261130). Returns the number released.
local now = now_ms(ARGV[1])
local window, limit = ARGV[2], tonumber(ARGV[3])
local ids = redis.call('ZRANGE', P .. 'held', 0, limit - 1)
local due = {}
for _, id in ipairs(ids) do
  local w = redis.call('HGET', jkey(id), 'held_window') or ''
  if w < window then due[#due + 1] = id end
end
if #due > 0 then
  bulk('ZREM', P .. 'held', due)
  make_ready(due, now, true)
end
return #due
