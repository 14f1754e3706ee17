-- Which of a GPU worker's leases have run longer than their queue's max run time (`timeout` in offload.yaml), on
-- the store's clock, counted from the claim (`started_at`). Read only: the caller fails each with fail.lua, fenced by
-- the token answered here, so a job that finished or moved on meanwhile is left alone.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, worker id, max run ms, then the job ids the worker holds
-- Returns: a flat list, 3 fields per overdue lease: id, token, attempt
--- @include "clock"
--- @include "records"
local now = now_ms(ARGV[1])
local wid, max_ms = ARGV[2], tonumber(ARGV[3])
local out = {}
for i = 4, #ARGV do
  local id = ARGV[i]
  local state, owner, token, started_at, attempts =
    unpack(redis.call('HMGET', jkey(id), 'state', 'owner', 'token', 'started_at', 'attempts'))
  if (state == 'active' or state == 'submitted') and owner == wid and now - tonumber(started_at or now) > max_ms then
    out[#out + 1] = id
    out[#out + 1] = token
    out[#out + 1] = attempts or '1'
  end
end
return out
