-- ARGV: now, id, token, backend, remote id. Records where the job runs BEFORE the worker polls it, so a
-- re-delivered job is resumed instead of submitted (and paid for) again. Returns OK, STALE or NOTFOUND;
-- OK:CANCEL when a cancel was requested meanwhile.
local now = now_ms(ARGV[1])
local id, token = ARGV[2], ARGV[3]
local f, err = owned(id, token)
if err then return err end
redis.call('HSET', jkey(id), 'state', 'submitted', 'backend', ARGV[4], 'remote_id', ARGV[5],
  'submitted_at', now)
redis.call('SADD', P .. 'submitted', id)
event({id}, 'submitted')
if redis.call('SISMEMBER', P .. 'cancelreq', id) == 1 then return 'OK:CANCEL' end
return 'OK'
