-- Gives the autoscaler's lock up, if the caller still holds it (a lock another server took since stays).
-- KEYS: [1] the lock (offload.autoscale.keyspace.LEADER)
-- ARGV: [1] owner
-- Returns: 1 when the lock was released, else 0
--- @include "leader"
local cur = redis.call('GET', KEYS[1])
if cur and lock_parts(cur) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
