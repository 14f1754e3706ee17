-- ARGV: now, id, token, reason. A leased job that may not be submitted (cap reached) waits in held,
-- without using up an attempt, until release.
local now = now_ms(ARGV[1])
local id, token = ARGV[2], ARGV[3]
local f, err = owned(id, token)
if err then return err end
local k = jkey(id)
unlease({id}, {[id] = f[2]})
redis.call('HINCRBY', k, 'attempts', -1)
redis.call('HSET', k, 'state', 'held', 'error', ARGV[4], 'held_at', now, 'owner', '', 'token', '')
redis.call('ZADD', P .. 'held', now, id)
event({id}, 'held')
return 'OK'
