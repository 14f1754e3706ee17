-- ARGV: now, worker id, lease ms, then the job ids the worker believes it holds.
-- One call extends every lease of the worker (leases hang off the worker's liveness, not each job).
-- Returns {lost ids, cancel-requested ids}.
local now = now_ms(ARGV[1])
local wid, lease = ARGV[2], tonumber(ARGV[3])
local owned_key = P .. 'owned:' .. wid
reap(now, 100)
redis.call('ZADD', P .. 'workers', now + lease, wid)
local lost, cancels = {}, {}
-- SMISMEMBER answers for a whole chunk of ids in one command, so verifying 10,000 leases stays a few calls.
for i = 4, #ARGV, 4000 do
  local ids = {unpack(ARGV, i, math.min(i + 3999, #ARGV))}
  local mine = redis.call('SMISMEMBER', owned_key, unpack(ids))
  local flagged = redis.call('SMISMEMBER', P .. 'cancelreq', unpack(ids))
  for j, id in ipairs(ids) do
    if mine[j] == 0 then
      lost[#lost + 1] = id
    elseif flagged[j] == 1 then
      cancels[#cancels + 1] = id
    end
  end
end
return {lost, cancels}
