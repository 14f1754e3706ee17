#!lua flags=allow-oom
-- The worker has cancelled the remote job: the job ends cancelled. `unsent` '1': the worker began the job's
-- submission and never sent its call (the cancel was heard in between): its intent closes and its cap
-- reservation is refunded (caps.lua, `close_unsent`), as a drain's hand-back does.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, id, token, unsent ('1' or absent)
-- Returns: OK, STALE or NOTFOUND
--- @include "clock"
--- @include "records"
--- @include "leases"
--- @include "terminal"
--- @include "attempts"
--- @include "caps"
local now = now_ms(ARGV[1])
local id, token = ARGV[2], ARGV[3]
local job, err = owned(id, token)
if err then return err end
if ARGV[4] == '1' then close_unsent(jkey(id), id, token) end
unlease({id}, {[id] = job.owner})
attempt_ended(id, now, 'cancelled')
finish({id}, 'cancelled', now, nil, {job})
return 'OK'
