#!lua flags=allow-oom
-- A remote worker's heartbeat stamps its registry record, only while the record exists: a heartbeat the server
-- was still handling when the worker deregistered (or its record expired) must not bring the record back.
-- KEYS: [1] the worker's record (offload.queue.keyspace.gpu_worker)
-- ARGV: [1] record TTL (ms), then field/value pairs to set
-- Returns: 1 when the record was stamped, 0 when it no longer exists
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
