-- Deletes up to limit jobs (records and index entries) of one waiting or finished set; active jobs are never
-- purged.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, set name, limit
-- Returns: the number deleted; callers loop until 0
--- @include "records"
--- @include "outbox"
local set, limit = ARGV[2], tonumber(ARGV[3])
local ids = redis.call('ZRANGE', P .. set, 0, limit - 1)
if #ids == 0 then return 0 end
bulk('ZREM', P .. set, ids)
outbox_forget(ids)
local keys = {}
for _, id in ipairs(ids) do
  keys[#keys + 1] = jkey(id)
  local idem = redis.call('HGET', jkey(id), 'idem')
  if idem then keys[#keys + 1] = P .. 'idem:' .. idem end  -- kept with no expiry while the job waited
end
for j = 1, #keys, CHUNK do redis.call('DEL', unpack(keys, j, math.min(j + CHUNK - 1, #keys))) end
return #ids
