-- ARGV: now, worker id, then ids (none: all the worker holds). A draining worker lets go of jobs it
-- will not finish; they go back to ready with their remote id, without counting as a lease expiry.
local now = now_ms(ARGV[1])
local wid = ARGV[2]
local owned_key = P .. 'owned:' .. wid
local ids = {}
if #ARGV > 2 then
  for i = 3, #ARGV do
    if redis.call('SISMEMBER', owned_key, ARGV[i]) == 1 then ids[#ids + 1] = ARGV[i] end
  end
else
  ids = redis.call('SMEMBERS', owned_key)
end
local n = return_leases(ids, now, false)
if #ARGV == 2 then
  redis.call('DEL', owned_key)
  redis.call('ZREM', P .. 'workers', wid)
end
return n
