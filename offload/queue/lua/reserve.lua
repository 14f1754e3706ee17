-- ARGV: now, id, window, job cap ('' = none), spend cap ('' = none), estimated cost.
-- The cap check and the count are one step, so any number of workers together submit exactly `cap` jobs
-- per window. A job already counted in this window (re-claimed after a crash before submit) passes
-- without being counted again. Returns OK, CAP:jobs or CAP:spend.
local id, window = ARGV[2], ARGV[3]
local base = P .. 'cap:' .. window .. ':'
if redis.call('SISMEMBER', base .. 'counted', id) == 1 then return 'OK' end
local jobs = tonumber(redis.call('GET', base .. 'jobs') or '0')
if ARGV[4] ~= '' and jobs >= tonumber(ARGV[4]) then return 'CAP:jobs' end
local spend = tonumber(redis.call('GET', base .. 'spend') or '0')
if ARGV[5] ~= '' and spend + tonumber(ARGV[6]) > tonumber(ARGV[5]) then return 'CAP:spend' end
redis.call('INCR', base .. 'jobs')
redis.call('SADD', base .. 'counted', id)
redis.call('INCRBYFLOAT', base .. 'spend', ARGV[6])
for _, k in ipairs({'jobs', 'counted', 'spend'}) do redis.call('EXPIRE', base .. k, 259200) end
return 'OK'
