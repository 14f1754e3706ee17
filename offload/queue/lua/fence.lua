-- Changes nothing: the last check before a worker writes where a newer owner of the job may write too (its output
-- in object storage).
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, items: a JSON list of [id, token]
-- Returns: per item OK (the token still holds the lease), STALE or NOTFOUND
--- @include "leases"
local out = {}
for _, item in ipairs(cjson.decode(ARGV[2])) do
  local id, token = item[1], item[2]
  local _, err = owned(id, token)
  out[#out + 1] = err or 'OK'
end
return out
