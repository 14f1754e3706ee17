#!lua flags=allow-oom
-- The worker has cancelled the remote job: the job ends cancelled.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, id, token
-- Returns: OK, STALE or NOTFOUND
--- @include "clock"
--- @include "leases"
--- @include "terminal"
--- @include "attempts"
local now = now_ms(ARGV[1])
local id, token = ARGV[2], ARGV[3]
local job, err = owned(id, token)
if err then return err end
unlease({id}, {[id] = job.owner})
attempt_ended(id, now, 'cancelled')
finish({id}, 'cancelled', now, nil, {job})
return 'OK'
