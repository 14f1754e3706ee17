-- Moves jobs back to ready: release of held jobs, requeue of dead ones (with a fresh attempt budget).
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, source set (held or dead), limit, then optional ids
-- Returns: the ids moved
--- @include "clock"
--- @include "records"
--- @include "ready"
local now = now_ms(ARGV[1])
local src, limit = ARGV[2], tonumber(ARGV[3])
local ids = {}
if #ARGV > 3 then
  for i = 4, #ARGV do ids[#ids + 1] = ARGV[i] end
else
  ids = redis.call('ZRANGE', P .. src, 0, limit - 1)
end
local moved = {}
for _, id in ipairs(ids) do
  if redis.call('ZREM', P .. src, id) == 1 then
    local k = jkey(id)
    if redis.call('EXISTS', k) == 1 then
      if src == 'dead' then
        redis.call('PERSIST', k)
        redis.call('HSET', k, 'attempts', 0, 'expiries', 0)
        redis.call('HDEL', k, 'finished_at', 'backend', 'remote_id', 'cancel')
        local sub = redis.call('HGET', k, 'sub_n')
        if sub then redis.call('HSET', k, 'remote_n', sub, 'sub_open', '0') end  -- a new run: a new number
        local idem = redis.call('HGET', k, 'idem')
        if idem then redis.call('PERSIST', P .. 'idem:' .. idem) end  -- not finished any more
      end
      moved[#moved + 1] = id
    end
  end
end
make_ready(moved, now, true)
return moved
