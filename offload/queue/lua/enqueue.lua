-- ARGV: now, count, check ids (1: ids may repeat, e.g. caller-chosen), then per job: id, input, meta,
-- where meta is "priority\trun_at\tmax_attempts\tretention\tidempotency key\toutput key" (empty output
-- key: results/<id>.json). Returns, per job, its id (an existing one when the idempotency key or the
-- id was seen before).
local now = now_ms(ARGV[1])
local n = tonumber(ARGV[2])
local check_ids = ARGV[3] == '1'
local out, ready, readyz, delayed, delayz = {}, {}, {}, {}, {}
local seq = redis.call('INCRBY', P .. 'seq', n) - n
local parsed = {}
local i = 4
for _ = 1, n do
  local id, input, meta = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  i = i + 3
  local m = parsed[meta]
  if not m then
    local prio, run_at, maxa, ret, idem, okey = string.match(meta, '^([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t(.*)$')
    m = {prio = prio, run_at = tonumber(run_at), maxa = maxa, ret = ret, idem = idem, okey = okey,
         base = (1000 - tonumber(prio)) * PRIO_SPAN}
    parsed[meta] = m
  end
  local existing = nil
  if m.idem ~= '' then
    local ik = P .. 'idem:' .. m.idem
    existing = redis.call('GET', ik)
    if existing and redis.call('EXISTS', jkey(existing)) == 0 then existing = nil end
    if not existing then redis.call('SET', ik, id, 'EX', math.max(tonumber(m.ret), 86400)) end
  end
  if not existing and check_ids and redis.call('EXISTS', jkey(id)) == 1 then existing = id end
  if existing then
    out[#out + 1] = existing
  else
    local okey = m.okey
    if okey == '' then okey = 'results/' .. id .. '.json' end
    seq = seq + 1
    local k = jkey(id)
    if m.run_at and m.run_at > now then
      redis.call('HSET', k, 'id', id, 'queue', QUEUE, 'input', input, 'priority', m.prio,
        'max_attempts', m.maxa, 'attempts', 0, 'expiries', 0, 'output_key', okey, 'retention', m.ret,
        'created_at', now, 'idem', m.idem, 'state', 'delayed', 'run_at', m.run_at)
      delayz[#delayz + 1] = m.run_at
      delayz[#delayz + 1] = id
      delayed[#delayed + 1] = id
    else
      local score = fmt(m.base + seq)
      redis.call('HSET', k, 'id', id, 'queue', QUEUE, 'input', input, 'priority', m.prio,
        'max_attempts', m.maxa, 'attempts', 0, 'expiries', 0, 'output_key', okey, 'retention', m.ret,
        'created_at', now, 'idem', m.idem, 'state', 'queued', 'score', score, 'ready_at', now)
      readyz[#readyz + 1] = score
      readyz[#readyz + 1] = id
      ready[#ready + 1] = id
    end
    out[#out + 1] = id
  end
end
bulk_zadd(P .. 'ready', readyz)
bulk_zadd(P .. 'delayed', delayz)
count('enqueued', #ready + #delayed)
event(ready, 'queued')
event(delayed, 'delayed')
return out
