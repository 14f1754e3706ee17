-- The worker's machine was taken away by its provider (pre-empted, stopped, vanished): that is not the jobs'
-- fault, so it costs them nothing. Its current leases go back to ready uncounted (with their remote ids); jobs
-- the reaper already took back from it counting lease expiries (remembered for a day in the hash lost:<worker>,
-- job -> count) get those expiries back, and one that an expiry had sent dead ("lease expired") is ready again.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, worker id
-- Returns: {released, refunded expiries, revived}
--- @include "clock"
--- @include "records"
--- @include "ready"
--- @include "leases"
local now = now_ms(ARGV[1])
local wid = ARGV[2]
local released = return_leases(redis.call('ZRANGE', P .. 'owned:' .. wid, 0, -1), now, false)
forget_worker(wid)
local lost_key = P .. 'lost:' .. wid
local refunded, revived = 0, {}
local lost = redis.call('HGETALL', lost_key)
for i = 1, #lost, 2 do
  local id, n = lost[i], tonumber(lost[i + 1])
  local k = jkey(id)
  local state, expiries, last_error, attempts, idem = unpack(redis.call('HMGET', k, 'state', 'expiries', 'error', 'attempts',
    'idem'))
  local exp = tonumber(expiries or 0)
  if state and exp > 0 then
    local back = math.min(n, exp)
    redis.call('HSET', k, 'expiries', exp - back)
    refunded = refunded + back
    if state == 'dead' and last_error == 'lease expired' then
      redis.call('ZREM', P .. 'dead', id)
      redis.call('HSET', k, 'attempts', math.max(tonumber(attempts or 1) - 1, 0))
      redis.call('HDEL', k, 'error', 'finished_at')
      if idem and idem ~= '' then redis.call('PERSIST', P .. 'idem:' .. idem) end  -- not finished any more
      revived[#revived + 1] = id
    end
  end
end
redis.call('DEL', lost_key)
make_ready(revived, now, true)
return {released, refunded, #revived}
