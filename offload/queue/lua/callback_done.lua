#!lua flags=allow-oom
-- The outcome of one completion-webhook try, from the sender that claimed it (callback_claim.lua): delivered
-- (it leaves the outbox), another try later, or dead-lettered with its reason; each counted in `cb:stats`.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, job id, claim token, outcome (ok, retry or dead), next try at (ms, for retry), error ('' for ok)
-- Returns: OK, or STALE when the claim is not this sender's any more (it ran out and another sender took it)
--- @include "clock"
--- @include "records"
local now = now_ms(ARGV[1])
local id, token, outcome = ARGV[2], ARGV[3], ARGV[4]
local raw = redis.call('HGET', P .. 'cb:info', id)
if not raw or not redis.call('ZSCORE', P .. 'cb:due', id) then return 'STALE' end
local info = cjson.decode(raw)
if info.token ~= token then return 'STALE' end
if outcome == 'ok' then
  redis.call('ZREM', P .. 'cb:due', id)
  redis.call('HDEL', P .. 'cb:info', id)
  redis.call('HINCRBY', P .. 'cb:stats', 'delivered', 1)
  return 'OK'
end
redis.call('HINCRBY', P .. 'cb:stats', 'failed_try', 1)
info.token, info.tries, info.error, info.at = nil, (info.tries or 0) + 1, ARGV[6], now
redis.call('HSET', P .. 'cb:info', id, cjson.encode(info))
if outcome == 'retry' then
  redis.call('ZADD', P .. 'cb:due', tonumber(ARGV[5]), id)
else
  redis.call('ZREM', P .. 'cb:due', id)
  redis.call('ZADD', P .. 'cb:failed', now, id)
  redis.call('HINCRBY', P .. 'cb:stats', 'dead_lettered', 1)
end
return 'OK'
