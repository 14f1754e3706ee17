-- One consistent snapshot of a queue: counts per state, oldest ready age, live workers, totals. The ready set is
-- ordered by priority then FIFO, so the oldest ready job is the first of some priority level: look at the head of
-- each level present (few in practice) instead of keeping a second index.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now
-- Returns: {paused (0/1), ready, delayed, active not yet submitted, submitted, retry, held, succeeded, dead, cancelled,
--   oldest ready age (ms), live workers, the stats hash as a flat list, today's spend per kind of capacity (the
--   store's UTC day, spend.lua) and the spend per kind since the queue began (flat lists: kind, USD as a string)}
--- @include "clock"
--- @include "records"
--- @include "ready"
local now = now_ms(ARGV[1])
local active = redis.call('ZCARD', P .. 'active')
local submitted = redis.call('SCARD', P .. 'submitted')
local oldest = nil
local from = '-inf'
for _ = 1, 64 do
  local head = redis.call('ZRANGE', P .. 'ready', from, '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
  if #head == 0 then break end
  local ready_at, created_at = unpack(redis.call('HMGET', jkey(head[1]), 'ready_at', 'created_at'))
  local t = tonumber(ready_at or created_at or now)
  if not oldest or t < oldest then oldest = t end
  from = fmt((math.floor(tonumber(head[2]) / PRIO_SPAN) + 1) * PRIO_SPAN)
end
local age = -1
if oldest then age = now - oldest end
return {
  redis.call('EXISTS', P .. 'paused'),
  redis.call('ZCARD', P .. 'ready'),
  redis.call('ZCARD', P .. 'delayed'),
  active - submitted,
  submitted,
  redis.call('ZCARD', P .. 'retry'),
  redis.call('ZCARD', P .. 'held'),
  redis.call('ZCARD', P .. 'succeeded'),
  redis.call('ZCARD', P .. 'dead'),
  redis.call('ZCARD', P .. 'cancelled'),
  age,
  redis.call('ZCOUNT', P .. 'workers', now, '+inf'),
  redis.call('HGETALL', P .. 'stats'),
  redis.call('HGETALL', P .. 'spend:' .. window_of(now)),
  redis.call('HGETALL', P .. 'spent'),
}
