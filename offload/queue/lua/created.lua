-- One chunk of a state's set with each job's creation time, for the listing of every state, newest first
-- (offload/queue/listing.py): one call per chunk instead of one HGET per job; a job whose record is gone (trimmed
-- since it was indexed) is left out. Read-only.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now (unused), set name, start index, count
-- Returns: {the number of ids read (fewer than count: the set's end), {id, created_at, id, created_at, ...}}
--- @include "records"
local start = tonumber(ARGV[3])
local ids = redis.call('ZRANGE', P .. ARGV[2], start, start + tonumber(ARGV[4]) - 1)
local out, n = {}, 0
for _, id in ipairs(ids) do
  local created = redis.call('HGET', jkey(id), 'created_at')
  if created then
    out[n + 1], out[n + 2] = id, created
    n = n + 2
  end
end
return {#ids, out}
