-- ARGV: now, worker id, max jobs, lease ms. Claiming also proves the worker alive, promotes due delayed
-- jobs, returns the jobs of dead workers to ready and deletes expired records (a bounded amount of each),
-- so a queue that has workers needs no separate scheduler to make progress.
-- Returns a flat list, 9 fields per job: id, token, attempt, max_attempts, input, output_key, backend,
-- remote_id, cancel.
local now = now_ms(ARGV[1])
local wid, n, lease = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('ZADD', P .. 'workers', now + lease, wid)
promote(now, 1000)
reap(now, 100)
trim(now, 100)
if n <= 0 or redis.call('EXISTS', P .. 'paused') == 1 then return {} end
local popped = redis.call('ZPOPMIN', P .. 'ready', n)
if #popped == 0 then return {} end
local out, ids, active, submitted, cancels, waits = {}, {}, {}, {}, {}, {}
local base = redis.call('INCRBY', P .. 'tok', #popped / 2) - #popped / 2
for j = 1, #popped, 2 do
  local id = popped[j]
  local k = jkey(id)
  local f = redis.call('HMGET', k, 'max_attempts', 'attempts', 'remote_id', 'input', 'output_key', 'backend',
    'cancel', 'ready_at', 'created_at')
  if f[1] then
    base = base + 1
    local token = wid .. '/' .. base
    local attempt = tonumber(f[2] or 0) + 1
    local state = 'active'
    if f[3] and f[3] ~= '' then
      state = 'submitted'
      submitted[#submitted + 1] = id
    end
    redis.call('HSET', k, 'state', state, 'owner', wid, 'token', token, 'started_at', now, 'attempts', attempt)
    ids[#ids + 1] = id
    active[#active + 1] = now
    active[#active + 1] = id
    if f[7] == '1' then cancels[#cancels + 1] = id end
    waits[#waits + 1] = now - tonumber(f[8] or f[9] or now)
    out[#out + 1] = id
    out[#out + 1] = token
    out[#out + 1] = attempt
    out[#out + 1] = f[1]
    out[#out + 1] = f[4]
    out[#out + 1] = f[5] or ('results/' .. id .. '.json')
    out[#out + 1] = f[6] or ''
    out[#out + 1] = f[3] or ''
    out[#out + 1] = f[7] or '0'
  end
end
bulk_zadd(P .. 'active', active)
bulk('SADD', P .. 'owned:' .. wid, ids)
bulk('SADD', P .. 'submitted', submitted)
bulk('SADD', P .. 'cancelreq', cancels)
event(ids, 'active')
observe('wait', waits)
return out
