-- Deletes up to limit jobs (records and index entries) of one waiting or finished set; active jobs are never
-- purged. With ids, only those of them still in the set (a job that left it meanwhile is kept).
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, set name, limit, then optional ids
-- Returns: the number deleted; callers loop until 0
--- @include "records"
--- @include "outbox"
--- @include "attempts"
local set, limit = ARGV[2], tonumber(ARGV[3])
local ids = {}
if #ARGV > 3 then
  for i = 4, #ARGV do
    if redis.call('ZREM', P .. set, ARGV[i]) == 1 then ids[#ids + 1] = ARGV[i] end
  end
  if #ids == 0 then return 0 end
else
  ids = redis.call('ZRANGE', P .. set, 0, limit - 1)
  if #ids == 0 then return 0 end
  bulk('ZREM', P .. set, ids)
end
outbox_forget(ids)
local keys = attempt_keys(ids, {})  -- the attempts go with the job
for _, id in ipairs(ids) do
  keys[#keys + 1] = jkey(id)
  local idem = redis.call('HGET', jkey(id), 'idem')
  if idem then keys[#keys + 1] = P .. 'idem:' .. idem end  -- kept with no expiry while the job waited
end
for j = 1, #keys, CHUNK do redis.call('DEL', unpack(keys, j, math.min(j + CHUNK - 1, #keys))) end
return #ids
