#!lua flags=allow-oom
-- A leased job that may not be submitted (cap reached) waits in held, without using up an attempt, until release;
-- the window it was held in is kept so it is released once the store's window (its UTC day) is later.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, id, token, reason, cap window (optional, digits)
-- Returns: OK, STALE or NOTFOUND
--- @include "clock"
--- @include "leases"
local now = now_ms(ARGV[1])
local id, token = ARGV[2], ARGV[3]
local job, err = owned(id, token)
if err then return err end
hold_job(id, job.owner, now, ARGV[4], ARGV[5] or '')
return 'OK'
