-- ARGV: now, items: a JSON list of [id, token, backend, remote id, submission number (optional: the job's
-- current one)]. Records where each job runs BEFORE the worker polls it, so a re-delivered job is resumed
-- instead of submitted (and paid for) again, and closes the submit intent of that submission. Batched: a
-- worker with thousands of submissions in flight records them in a few calls, not one round trip each.
-- Returns per item OK, STALE or NOTFOUND; OK:CANCEL when a cancel was requested meanwhile.
local now = now_ms(ARGV[1])
local out, ids = {}, {}
local cancels = redis.call('SCARD', P .. 'cancelreq') > 0
for _, item in ipairs(cjson.decode(ARGV[2])) do
  local id, token = item[1], item[2]
  local _, err = owned(id, token)
  if err then
    out[#out + 1] = err
  else
    local k = jkey(id)
    local n = tonumber(item[5]) or tonumber(redis.call('HGET', k, 'sub_n') or '') or 1
    redis.call('HSET', k, 'state', 'submitted', 'backend', item[3], 'remote_id', item[4], 'submitted_at', now,
      'sub_n', n, 'remote_n', n, 'sub_open', '0')
    ids[#ids + 1] = id
    if cancels and redis.call('SISMEMBER', P .. 'cancelreq', id) == 1 then
      out[#out + 1] = 'OK:CANCEL'
    else
      out[#out + 1] = 'OK'
    end
  end
end
bulk('SADD', P .. 'submitted', ids)
event(ids, 'submitted')
return out
