-- ARGV: now, worker id. The worker's machine was taken away by its provider (pre-empted, stopped, vanished):
-- that is not the jobs' fault, so it costs them nothing. Its current leases go back to ready uncounted (with
-- their remote ids); jobs the reaper already took back from it counting a lease expiry (remembered for a day
-- in lost:<worker>) get that expiry back, and one that the expiry had sent dead ("lease expired") is ready
-- again. Returns {released, refunded, revived}.
local now = now_ms(ARGV[1])
local wid = ARGV[2]
local owned_key = P .. 'owned:' .. wid
local released = return_leases(redis.call('SMEMBERS', owned_key), now, false)
redis.call('DEL', owned_key)
redis.call('ZREM', P .. 'workers', wid)
local lost_key = P .. 'lost:' .. wid
local refunded, revived = 0, {}
for _, id in ipairs(redis.call('SMEMBERS', lost_key)) do
  local k = jkey(id)
  local f = redis.call('HMGET', k, 'state', 'expiries', 'error', 'attempts')
  local exp = tonumber(f[2] or 0)
  if f[1] and exp > 0 then
    redis.call('HSET', k, 'expiries', exp - 1)
    refunded = refunded + 1
    if f[1] == 'dead' and f[3] == 'lease expired' then
      redis.call('ZREM', P .. 'dead', id)
      redis.call('HSET', k, 'attempts', math.max(tonumber(f[4] or 1) - 1, 0))
      redis.call('HDEL', k, 'error', 'finished_at')
      revived[#revived + 1] = id
    end
  end
end
redis.call('DEL', lost_key)
make_ready(revived, now, true)
return {released, refunded, #revived}
