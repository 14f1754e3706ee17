-- KEYS[2]: a plain list the tutorial's producer RPUSHes JSON onto. ARGV: now, limit, max_attempts,
-- retention, queue name. Pop and enqueue happen in this one script, so no crash can lose an entry.
-- A malformed entry becomes a dead job carrying the parse error and the raw text. Returns {ingested, dead}.
local now = now_ms(ARGV[1])
local limit, maxa, ret, queue = tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local ok_n = 0
local queued, bad = {}, {}
for _ = 1, limit do
  local raw = redis.call('LPOP', KEYS[2])
  if not raw then break end
  local ok, job = pcall(cjson.decode, raw)
  local problem = nil
  if not ok then
    problem = 'invalid JSON: ' .. tostring(job)
  elseif type(job) ~= 'table' then
    problem = 'entry is not a JSON object'
  elseif (type(job.id) ~= 'string' and type(job.id) ~= 'number') or tostring(job.id) == '' then
    problem = 'field "id" is missing or not a string'
  elseif not string.match(tostring(job.id), '^[%w_%.%-]+$') or #tostring(job.id) > 128 then
    problem = 'field "id" has characters outside [A-Za-z0-9_.-] or is longer than 128'
  elseif job.input == nil or job.input == cjson.null then
    problem = 'field "input" is missing'
  elseif job.output_key ~= nil and type(job.output_key) ~= 'string' then
    problem = 'field "output_key" is not a string'
  elseif job.attempt ~= nil and type(job.attempt) ~= 'number' then
    problem = 'field "attempt" is not a number'
  end
  if problem then
    local id = queue .. ':malformed-' .. redis.call('INCR', P .. 'seq')
    local k = jkey(id)
    redis.call('HSET', k, 'id', id, 'queue', queue, 'input', '', 'raw', raw, 'priority', 0,
      'max_attempts', maxa, 'attempts', 0, 'expiries', 0, 'output_key', '', 'retention', ret,
      'created_at', now)
    redis.call('HSET', k, 'error', 'malformed tutorial job: ' .. problem)
    bad[#bad + 1] = id
  else
    local tid = tostring(job.id)
    local id = queue .. ':' .. tid
    local k = jkey(id)
    local ik = P .. 'idem:tutorial:' .. tid
    if redis.call('EXISTS', k) == 0 then
      local okey = job.output_key or ('results/' .. tid .. '.json')
      local prior = math.max((tonumber(job.attempt) or 1) - 1, 0)
      local score = PRIO_SPAN * 1000 + redis.call('INCR', P .. 'seq')
      redis.call('HSET', k, 'id', id, 'queue', queue, 'input', cjson.encode(job.input), 'priority', 0,
        'max_attempts', maxa, 'attempts', prior, 'expiries', 0, 'output_key', okey, 'retention', ret,
        'created_at', now, 'idem', 'tutorial:' .. tid, 'state', 'queued', 'score', fmt(score),
        'ready_at', now)
      redis.call('SET', ik, id, 'EX', math.max(tonumber(ret), 86400))
      redis.call('ZADD', P .. 'ready', fmt(score), id)
      queued[#queued + 1] = id
    end
    ok_n = ok_n + 1
  end
end
count('enqueued', #queued + #bad)
event(queued, 'queued')
finish(bad, 'dead', now, nil, nil)
return {ok_n, #bad}
