-- A sender's claim of the completion webhooks that are due (offload/server/callbacks.py): each is pushed to the
-- claim's end, so no other server sends it meanwhile, and one whose sender died comes due again then.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, limit, claim ms (how long the sender owns each; more than one POST's timeout)
-- Returns: per webhook claimed, {job id, token (the claim's: callback_done.lua checks it), tries made before}
--- @include "clock"
--- @include "records"
local now = now_ms(ARGV[1])
local limit, claim_ms = tonumber(ARGV[2]), tonumber(ARGV[3])
local due = redis.call('ZRANGEBYSCORE', P .. 'cb:due', '-inf', now, 'LIMIT', 0, limit)
local out = {}
for i, id in ipairs(due) do
  local token = tostring(redis.call('INCR', P .. 'cb:tok'))
  redis.call('ZADD', P .. 'cb:due', now + claim_ms, id)
  local raw = redis.call('HGET', P .. 'cb:info', id)
  local info = raw and cjson.decode(raw) or {}
  info.token = token
  redis.call('HSET', P .. 'cb:info', id, cjson.encode(info))
  out[i] = {id, token, tostring(info.tries or 0)}
end
return out
