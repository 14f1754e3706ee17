-- ARGV: now, id, token, reason, cap window (optional). A leased job that may not be submitted (cap
-- reached) waits in held, without using up an attempt, until release; the window it was held in is kept so
-- workers release it when their window is later, whatever their clocks say about wall time.
local now = now_ms(ARGV[1])
local id, token = ARGV[2], ARGV[3]
local f, err = owned(id, token)
if err then return err end
local k = jkey(id)
unlease({id}, {[id] = f[2]})
redis.call('HINCRBY', k, 'attempts', -1)
redis.call('HSET', k, 'state', 'held', 'error', ARGV[4], 'held_at', now, 'owner', '', 'token', '',
  'held_window', ARGV[5] or '')
redis.call('ZADD', P .. 'held', now, id)
event({id}, 'held')
return 'OK'
