#!lua flags=allow-oom
-- At most one alert of a kind and subject per cooldown, across every server: the check and the mark are one
-- step, so two servers noticing the same problem at once send it once.
-- KEYS: [1] the alert's last-sent key (offload.autoscale.keyspace.alert)
-- ARGV: [1] now (s), [2] cooldown (s)
-- Returns: 1 when the alert should go out now, 0 when one went out within the cooldown
local last = redis.call('GET', KEYS[1])
if last and tonumber(ARGV[1]) - tonumber(last) < tonumber(ARGV[2]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', math.max(1, math.ceil(tonumber(ARGV[2]))))
return 1
