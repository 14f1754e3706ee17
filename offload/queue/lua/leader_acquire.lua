-- Takes or renews the autoscaler's lock. A new holder gets the next fencing token; the holder renewing with
-- its token keeps it. An unexpired lock of another owner is left alone.
-- KEYS: [1] the lock (offload.autoscale.keyspace.LEADER), [2] the fencing-token counter (FENCE)
-- ARGV: [1] owner, [2] now (ms), [3] ttl (ms), [4] the caller's current token ('' none)
-- Returns: the caller's token (a string) while it holds the lock, else false (nil)
--- @include "leader"
local cur = redis.call('GET', KEYS[1])
local now, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
if cur then
  local owner, tok, exp = lock_parts(cur)
  if owner == ARGV[1] and tok == ARGV[4] then
    redis.call('SET', KEYS[1], owner .. '|' .. tok .. '|' .. (now + ttl), 'PX', ttl)
    return tok
  end
  if tonumber(exp) and tonumber(exp) > now then return false end
end
local t = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. t .. '|' .. (now + ttl), 'PX', ttl)
return tostring(t)
