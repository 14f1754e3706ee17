-- A job's attempts in one read (offload/queue/attempts.py): the ones written when they ended (attempts.lua) and
-- the fields of the job's record its current attempt is read from, as of the same moment. Read-only.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now (unused), job id
-- Returns: {} for no such job, else {the attempts hash as a flat list, the job's fields in CURRENT's order}
--- @include "records"
--- @include "attempts"
local CURRENT = {'state', 'started_at', 'token', 'backend', 'remote_id', 'sub_n', 'remote_n', 'submitted_at',
  'adopted_at', 'hook_n', 'finished_at', 'cost', 'kind'}
local id = ARGV[2]
local fields = redis.call('HMGET', jkey(id), unpack(CURRENT))
if not fields[1] then return {} end
return {redis.call('HGETALL', att_key(id)), fields}
