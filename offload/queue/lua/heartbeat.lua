-- ARGV: now, worker id, lease ms, then the job ids the worker believes it holds.
-- One call extends every lease of the worker (leases hang off the worker's liveness, not each job).
-- Returns {lost ids, cancel-requested ids}.
local now = now_ms(ARGV[1])
local wid, lease = ARGV[2], tonumber(ARGV[3])
local owned_key = P .. 'owned:' .. wid
reap(now, 100)
redis.call('ZADD', P .. 'workers', now + lease, wid)
local lost, cancels = {}, {}
for i = 4, #ARGV do
  local id = ARGV[i]
  if redis.call('SISMEMBER', owned_key, id) == 0 then
    lost[#lost + 1] = id
  elseif redis.call('SISMEMBER', P .. 'cancelreq', id) == 1 then
    cancels[#cancels + 1] = id
  end
end
return {lost, cancels}
