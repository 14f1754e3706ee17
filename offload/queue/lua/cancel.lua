-- A waiting job is cancelled at once; an active one is flagged so its worker cancels the remote job and
-- acknowledges.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keys.py)
-- ARGV: now, id
-- Returns: cancelled, requested, NOTFOUND, or ALREADY:<terminal state>
--- @include "common"
local now = now_ms(ARGV[1])
local id = ARGV[2]
local k = jkey(id)
local state = redis.call('HGET', k, 'state')
if not state then return 'NOTFOUND' end
if state == 'succeeded' or state == 'dead' or state == 'cancelled' then return 'ALREADY:' .. state end
if state == 'active' or state == 'submitted' then
  redis.call('HSET', k, 'cancel', '1')
  redis.call('SADD', P .. 'cancelreq', id)
  event({id}, 'cancel_requested')
  return 'requested'
end
local sets = {queued = 'ready', delayed = 'delayed', retrying = 'retry', held = 'held'}
redis.call('ZREM', P .. sets[state], id)
finish({id}, 'cancelled', now, nil, nil)
return 'cancelled'
