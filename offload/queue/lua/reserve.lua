-- ARGV: now, window, job cap ('' = none), spend cap ('' = none), items: a JSON list of [id, estimated cost].
-- The cap check and the count are one step, so any number of workers together submit exactly `cap` jobs
-- per window; items are decided in order, as if reserved one by one. A job already counted in this window
-- (re-claimed after a crash before submit) passes without being counted again.
-- Returns per item OK, CAP:jobs or CAP:spend.
local window = ARGV[2]
local base = P .. 'cap:' .. window .. ':'
local job_cap, spend_cap = tonumber(ARGV[3]), tonumber(ARGV[4])
local jobs = tonumber(redis.call('GET', base .. 'jobs') or '0')
local spend = tonumber(redis.call('GET', base .. 'spend') or '0')
local out, counted, added = {}, {}, 0
for _, item in ipairs(cjson.decode(ARGV[5])) do
  local id, cost = item[1], tonumber(item[2])
  if redis.call('SISMEMBER', base .. 'counted', id) == 1 then
    out[#out + 1] = 'OK'
  elseif job_cap and jobs >= job_cap then
    out[#out + 1] = 'CAP:jobs'
  elseif spend_cap and spend + cost > spend_cap then
    out[#out + 1] = 'CAP:spend'
  else
    jobs = jobs + 1
    spend = spend + cost
    added = added + cost
    redis.call('SADD', base .. 'counted', id)
    counted[#counted + 1] = id
    out[#out + 1] = 'OK'
  end
end
if #counted > 0 then
  redis.call('INCRBY', base .. 'jobs', #counted)
  redis.call('INCRBYFLOAT', base .. 'spend', added)
  for _, k in ipairs({'jobs', 'counted', 'spend'}) do redis.call('EXPIRE', base .. k, 259200) end
end
return out
