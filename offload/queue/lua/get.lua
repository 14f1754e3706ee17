-- The job record plus its lease deadline (leases live on the owning worker).
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, id
-- Returns: {} for no such job, else {the job hash as a flat list, its lease deadline in ms or ''}
--- @include "records"
local h = redis.call('HGETALL', jkey(ARGV[2]))
if #h == 0 then return {} end
local owner = redis.call('HGET', jkey(ARGV[2]), 'owner')
local deadline = ''
if owner then deadline = redis.call('ZSCORE', P .. 'workers', owner) or '' end
return {h, deadline}
