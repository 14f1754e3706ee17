-- Dead-lettered completion webhooks back into the outbox, due now, with a fresh budget of tries.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, limit, then optional job ids (none: the oldest `limit` dead-lettered)
-- Returns: the job ids requeued
--- @include "clock"
--- @include "records"
local now = now_ms(ARGV[1])
local ids = {}
if #ARGV > 2 then
  for i = 3, #ARGV do ids[#ids + 1] = ARGV[i] end
else
  ids = redis.call('ZRANGE', P .. 'cb:failed', 0, tonumber(ARGV[2]) - 1)
end
local moved = {}
for _, id in ipairs(ids) do
  if redis.call('ZREM', P .. 'cb:failed', id) == 1 then
    redis.call('HDEL', P .. 'cb:info', id)
    redis.call('ZADD', P .. 'cb:due', now, id)
    moved[#moved + 1] = id
  end
end
if #moved > 0 then redis.call('HINCRBY', P .. 'cb:stats', 'requeued', #moved) end
return moved
