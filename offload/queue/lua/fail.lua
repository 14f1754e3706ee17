-- ARGV: now, id, token, error, retryable (1/0), delay ms, keep remote id (1/0).
-- A retry is scheduled in Redis (the worker never sleeps); exhausted or fatal goes dead with the reason.
-- Returns retrying, dead, STALE or NOTFOUND.
local now = now_ms(ARGV[1])
local id, token, err_text = ARGV[2], ARGV[3], ARGV[4]
local f, err = owned(id, token)
if err then return err end
local k = jkey(id)
unlease({id}, {[id] = f[2]})
count('failed', 1)
local g = redis.call('HMGET', k, 'attempts', 'max_attempts')
if ARGV[5] == '1' and tonumber(g[1]) < tonumber(g[2]) then
  local at = now + tonumber(ARGV[6])
  redis.call('HSET', k, 'state', 'retrying', 'error', err_text, 'run_at', at, 'owner', '', 'token', '')
  if ARGV[7] ~= '1' then redis.call('HDEL', k, 'backend', 'remote_id') end
  redis.call('ZADD', P .. 'retry', at, id)
  event({id}, 'retrying')
  return 'retrying'
end
finish({id}, 'dead', now, err_text, {f[3]})
return 'dead'
