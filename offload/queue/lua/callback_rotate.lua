-- A queue's completion-webhook signing secret replaced: the current one becomes the previous, kept (and signed
-- with as well) until the grace ends, so receivers can switch without a webhook failing verification.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, the new secret (sealed by the vault), grace ms (0: the old one stops at once)
-- Returns: OK
--- @include "clock"
--- @include "records"
local now = now_ms(ARGV[1])
local key = P .. 'cb:secret'
local current = redis.call('HGET', key, 'current')
if current and tonumber(ARGV[3]) > 0 then
  redis.call('HSET', key, 'previous', current, 'previous_until', now + tonumber(ARGV[3]))
else
  redis.call('HDEL', key, 'previous', 'previous_until')
end
redis.call('HSET', key, 'current', ARGV[2])
return 'OK'
