-- ARGV: now, limit. Maintenance: promote due delayed jobs, return dead workers' jobs, and delete the
-- records of finished jobs whose retention ran out. Returns {promoted, reaped, trimmed}.
local now = now_ms(ARGV[1])
local limit = tonumber(ARGV[2])
local promoted = promote(now, limit)
local reaped = reap(now, limit)
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
return {promoted, reaped, trimmed}
