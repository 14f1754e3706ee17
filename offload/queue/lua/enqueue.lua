-- One JSON argument per batch instead of one argument per field is what makes bulk enqueue cheap on both sides of
-- the connection. The nonce makes a repeat of the same call (its reply was lost and the client sent it again)
-- check every id, so it returns the jobs the first run made instead of putting them into ready a second time,
-- where they may already be leased. Fresh calls skip that check: their ids are new.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, check ids (1: ids may repeat, e.g. caller-chosen), metas, jobs, batch nonce (random per call).
--   metas is a JSON list of "priority\trun_at\tmax_attempts\tretention\tidempotency key\toutput key\tdeadline\t
--   max cost[\tcallback URL]" strings (empty output key: results/<id>.json; run_at and deadline: epoch ms, ''
--   none, or "+<ms>": from the store's now, so a producer's clock never decides when its job is due; max cost:
--   USD, '' none; callback URL: where its completion webhook goes, '' none); jobs is a JSON list of [id, input,
--   meta index(, file keys(, traceparent))], the file keys (a JSON list of the object keys the input refers to)
--   only for an input with files (else false when a traceparent follows), the traceparent (the W3C context of
--   its enqueue span, offload/tracing.py) only while tracing is on
-- Returns: per job, its id (an existing one when the idempotency key or the id was seen before), or
--   {id, 'gone'} when the key's job finished and its record was trimmed: the key still answers (a repeat
--   never makes a second, paid run while the key lives), and the caller is told the record is gone
--- @include "clock"
--- @include "records"
--- @include "events"
--- @include "metrics"
--- @include "history"
--- @include "ready"
--- @include "outages"
local now = now_ms(ARGV[1])
rewind(now)  -- before a delay is scheduled on the store's clock
local check_ids = ARGV[2] == '1'
if ARGV[5] and ARGV[5] ~= '' and not redis.call('SET', P .. 'enq:' .. ARGV[5], '1', 'NX', 'EX', 600) then
  check_ids = true
end
local metas = cjson.decode(ARGV[3])
local jobs = cjson.decode(ARGV[4])
local n = #jobs
local out, ready, readyz, delayed, delayz = {}, {}, {}, {}, {}
local seq = redis.call('INCRBY', P .. 'seq', n) - n
local parsed = {}
for _, job in ipairs(jobs) do
  local id, input, meta, files, traceparent = job[1], job[2], metas[job[3]], job[4], job[5]
  local m = parsed[meta]
  if not m then
    local prio, run_at, maxa, ret, idem, okey, dl, mc = string.match(meta,
      '^([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t([^\t]*)\t(.*)$')
    local delay = string.match(run_at, '^%+(%d+)$')
    m = {prio = prio, run_at = tonumber(run_at), maxa = maxa, ret = ret, idem = idem, okey = okey,
         base = (1000 - tonumber(prio)) * PRIO_SPAN, delay = delay, deadline = tonumber(dl), max_cost = mc,
         callback = ''}
    local cost, callback = string.match(mc, '^([^\t]*)\t(.*)$')
    if cost then m.max_cost, m.callback = cost, callback end
    if delay then m.run_at = now + tonumber(delay) end
    local within = string.match(dl, '^%+(%d+)$')
    if within then m.deadline = now + tonumber(within) end  -- kept absolute: a time of day, like run_at
    parsed[meta] = m
  end
  local existing, gone = nil, false
  if m.idem ~= '' then
    local ik = P .. 'idem:' .. m.idem
    existing = redis.call('GET', ik)
    gone = existing and redis.call('EXISTS', jkey(existing)) == 0
    if not existing then redis.call('SET', ik, id) end  -- no expiry until the job finishes (terminal.lua's finish)
  end
  if not existing and check_ids and redis.call('EXISTS', jkey(id)) == 1 then existing = id end
  if gone then
    out[#out + 1] = {existing, 'gone'}
  elseif existing then
    out[#out + 1] = existing
  else
    seq = seq + 1
    local k = jkey(id)
    -- Only what differs from the defaults is stored (attempts 0, output key results/<id>.json, ready
    -- since creation): fewer hash fields make every later read and write of the job cheaper.
    if m.run_at and m.run_at > now then
      redis.call('HSET', k, 'input', input, 'priority', m.prio, 'max_attempts', m.maxa, 'retention', m.ret,
        'created_at', now, 'state', 'delayed', 'run_at', m.run_at)
      if m.delay then redis.call('HSET', k, 'delay', m.delay) end  -- relative: `shift_back` moves it
      delayz[#delayz + 1] = m.run_at
      delayz[#delayz + 1] = id
      delayed[#delayed + 1] = id
    else
      local score = fmt(m.base + seq)
      redis.call('HSET', k, 'input', input, 'priority', m.prio, 'max_attempts', m.maxa, 'retention', m.ret,
        'created_at', now, 'state', 'queued', 'score', score)
      readyz[#readyz + 1] = score
      readyz[#readyz + 1] = id
      ready[#ready + 1] = id
    end
    if m.idem ~= '' then redis.call('HSET', k, 'idem', m.idem) end
    if m.okey ~= '' then redis.call('HSET', k, 'output_key', m.okey) end
    if files then redis.call('HSET', k, 'files', files) end
    if traceparent then redis.call('HSET', k, 'traceparent', traceparent) end
    if m.deadline then redis.call('HSET', k, 'deadline', fmt(m.deadline)) end
    if m.max_cost ~= '' then redis.call('HSET', k, 'max_cost', m.max_cost) end
    if m.callback ~= '' then redis.call('HSET', k, 'callback', m.callback) end
    out[#out + 1] = id
  end
end
bulk_zadd(P .. 'ready', readyz)
bulk_zadd(P .. 'delayed', delayz)
if #ready > 0 then wake() end
count('enqueued', #ready + #delayed)
history_add(now, {'enqueued', #ready + #delayed})
event(ready, 'queued')
event(delayed, 'delayed')
return out
