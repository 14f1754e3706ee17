-- A waiting job is cancelled at once; an active one is flagged so its worker cancels the remote job and
-- acknowledges. So is a waiting job whose remote job may still run (a drained or crashed worker handed it back
-- with its remote id, or with a submission whose outcome is unknown): it goes first in the ready set (make_ready),
-- and the dispatch worker that claims it cancels the remote job (or the one it finds by tag) before it acknowledges;
-- until then the answer stays `requested`. Such a job is never submitted again (begin.lua refuses a cancel) and
-- takes no cap (a claim under a cap takes it; the worker cancels before any begin).
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, id
-- Returns: cancelled, requested, NOTFOUND, or ALREADY:<terminal state>
--- @include "clock"
--- @include "records"
--- @include "events"
--- @include "ready"
--- @include "terminal"
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
local remote_id, sub_open = unpack(redis.call('HMGET', k, 'remote_id', 'sub_open'))
if (remote_id and remote_id ~= '') or sub_open == '1' then
  redis.call('HSET', k, 'cancel', '1')
  make_ready({id}, now, true)
  event({id}, 'cancel_requested')
  return 'requested'
end
finish({id}, 'cancelled', now, nil, nil)
return 'cancelled'
