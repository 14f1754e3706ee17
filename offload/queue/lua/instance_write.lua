-- A fenced write of one rented instance: only the leader holding the lock with this token may change it (a
-- deposed leader's write, and the provider call after it, must not happen), the instance's status must be one
-- the change allows, and the live set and creation index change in the same step.
-- KEYS: [1] the autoscaler's lock (LEADER), [2] the instance hash, [3] the live set (LIVE), [4] the creation
--   index (ALL) (offload.autoscale.keyspace)
-- ARGV: [1] the leader's fencing token, [2] expected status: '+create' (must not exist), '' (any) or a comma
--   list, [3] a JSON object of fields to set, [4] 'add', 'remove' or '' (the live set), [5] the instance id,
--   [6] its creation time (ms, the ALL score)
-- Returns: OK, FENCED, EXISTS, NOTFOUND or STATE:<current status>
--- @include "leader"
local cur = redis.call('GET', KEYS[1])
if ARGV[1] == '' or not cur then return 'FENCED' end
local _, tok = lock_parts(cur)
if tok ~= ARGV[1] then return 'FENCED' end
local status = redis.call('HGET', KEYS[2], 'status')
if ARGV[2] == '+create' then
  if status then return 'EXISTS' end
elseif not status then
  return 'NOTFOUND'
elseif ARGV[2] ~= '' then
  local ok = false
  for s in string.gmatch(ARGV[2], '[^,]+') do if s == status then ok = true end end
  if not ok then return 'STATE:' .. status end
end
local f = cjson.decode(ARGV[3])
local flat = {}
for k, v in pairs(f) do flat[#flat + 1] = k; flat[#flat + 1] = tostring(v) end
if #flat > 0 then redis.call('HSET', KEYS[2], unpack(flat)) end
if ARGV[4] == 'add' then
  redis.call('SADD', KEYS[3], ARGV[5])
  redis.call('ZADD', KEYS[4], ARGV[6], ARGV[5])
elseif ARGV[4] == 'remove' then
  redis.call('SREM', KEYS[3], ARGV[5])
end
return 'OK'
