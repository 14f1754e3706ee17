-- Pop and enqueue happen in this one script, so no crash can lose an entry. A malformed entry becomes a dead job
-- carrying the parse error and the raw text. The job's input is kept as the producer wrote it, byte for byte:
-- cjson only validates the entry, and the input's text is cut out of the raw entry (a cjson round trip would
-- round integers past 14 digits and turn [] into {}).
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py), [2] the plain list the
--   tutorial's producer RPUSHes JSON onto
-- ARGV: now, limit, max_attempts, retention, queue name
-- Returns: {ingested, dead}
--- @include "clock"
--- @include "records"
--- @include "events"
--- @include "metrics"
--- @include "history"
--- @include "ready"
--- @include "terminal"
local now = now_ms(ARGV[1])
local limit, maxa, ret, queue = tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local ok_n = 0
local queued, bad = {}, {}

local function skip_ws(t, i) return string.find(t, '[^ \t\r\n]', i) end

-- The position of the last byte of the JSON value that starts at `i` in `t` (valid JSON: cjson said so).
local function value_end(t, i)
  local c = string.sub(t, i, i)
  if c == '"' then
    local j = i + 1
    while true do
      local q = string.find(t, '["\\]', j)
      if string.sub(t, q, q) == '\\' then j = q + 2 else return q end
    end
  elseif c == '{' or c == '[' then
    local depth, j = 0, i
    while true do
      local q = string.find(t, '[%[%]{}"]', j)
      local d = string.sub(t, q, q)
      if d == '"' then
        j = value_end(t, q) + 1
      elseif d == '{' or d == '[' then
        depth, j = depth + 1, q + 1
      else
        depth, j = depth - 1, q + 1
        if depth == 0 then return q end
      end
    end
  end
  local _, e = string.find(t, '^[^,}%]%s]+', i)
  return e
end

-- The raw text of each member of the top-level object (the last one wins for a repeated name, as in cjson).
local function members(t)
  local spans = {}
  local i = skip_ws(t, skip_ws(t, 1) + 1)
  while string.sub(t, i, i) == '"' do
    local key_end = value_end(t, i)
    local key = cjson.decode(string.sub(t, i, key_end))
    local v = skip_ws(t, skip_ws(t, key_end + 1) + 1)
    local v_end = value_end(t, v)
    spans[key] = string.sub(t, v, v_end)
    i = skip_ws(t, v_end + 1)
    if string.sub(t, i, i) == ',' then i = skip_ws(t, i + 1) end
  end
  return spans
end

for _ = 1, limit do
  local raw = redis.call('LPOP', KEYS[2])
  if not raw then break end
  local ok, job = pcall(cjson.decode, raw)
  local problem = nil
  local spans = nil
  if ok and type(job) == 'table' and string.sub(raw, skip_ws(raw, 1) or 1, skip_ws(raw, 1) or 1) == '{' then
    spans = members(raw)
  end
  if not ok then
    problem = 'invalid JSON: ' .. tostring(job)
  elseif not spans then
    problem = 'entry is not a JSON object'
  elseif (type(job.id) ~= 'string' and type(job.id) ~= 'number') or tostring(job.id) == '' then
    problem = 'field "id" is missing or not a string'
  elseif type(job.id) == 'string' and (not string.match(job.id, '^[%w_%.%-]+$') or #job.id > 128) then
    problem = 'field "id" has characters outside [A-Za-z0-9_.-] or is longer than 128'
  elseif type(job.id) == 'number' and (not string.match(spans.id, '^[%w_%.%-]+$') or #spans.id > 128) then
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
    local tid = job.id
    if type(tid) == 'number' then tid = spans.id end  -- as written: 12345678901234567 stays itself
    local id = queue .. ':' .. tid
    local k = jkey(id)
    local ik = P .. 'idem:tutorial:' .. tid
    -- the key outlives the record (terminal.lua's idem_expire): a job re-pushed after its record was trimmed has
    -- run already and is not run (and paid for) again while the key lives
    if redis.call('EXISTS', k) == 0 and redis.call('EXISTS', ik) == 0 then
      local okey = job.output_key or ('results/' .. tid .. '.json')
      local prior = math.max((tonumber(job.attempt) or 1) - 1, 0)
      local score = PRIO_SPAN * 1000 + redis.call('INCR', P .. 'seq')
      redis.call('HSET', k, 'id', id, 'queue', queue, 'input', spans.input, 'priority', 0,
        'max_attempts', maxa, 'attempts', prior, 'expiries', 0, 'output_key', okey, 'retention', ret,
        'created_at', now, 'idem', 'tutorial:' .. tid, 'state', 'queued', 'score', fmt(score),
        'ready_at', now)
      redis.call('SET', ik, id)
      redis.call('ZADD', P .. 'ready', fmt(score), id)
      queued[#queued + 1] = id
    end
    ok_n = ok_n + 1
  end
end
count('enqueued', #queued + #bad)
history_add(now, {'enqueued', #queued + #bad})
event(queued, 'queued')
if #queued > 0 then wake() end
finish(bad, 'dead', now, nil, nil)
return {ok_n, #bad}
