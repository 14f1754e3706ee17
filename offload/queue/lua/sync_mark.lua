-- A write that always reaches the replication stream, sent right before a WAIT (offload/queue/durability.py): the
-- WAIT then covers every write the primary applied so far, also one a resent script no longer repeats. DEL first:
-- at `maxmemory` a script may not begin with a write that can grow memory (SET), but may go on once it has written.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: (none)
-- Returns: 1
local P = KEYS[1]
redis.call('DEL', P .. 'synced')
redis.call('SET', P .. 'synced', '1')
return 1
