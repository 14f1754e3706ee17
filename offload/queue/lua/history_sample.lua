-- One sample of the queue's gauges into its history (history.lua), and the history's settings from offload.yaml.
-- Every server samples each minute: each bucket keeps the highest sample it got (a max is the same whichever
-- server wrote first and however often), so a minute's point is that minute's peak, an hour's the hour's.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now ('' the store's clock), on (1/0), minutes kept ms, hours kept ms, days kept ms, then gauge name and
--   value pairs (backlog, in_flight, fleet_machines, fleet_usd_per_h; '' for a value not known)
-- Returns: the bucket start (ms) of the minute sampled
--- @include "clock"
--- @include "records"
--- @include "history"
local now = now_ms(ARGV[1])
redis.call('HSET', P .. 'history:cfg', 'on', ARGV[2], 'm', ARGV[3], 'h', ARGV[4], 'd', ARGV[5])
-- kept as long as the history it sets (a day past the longest retention): a queue nobody samples any more, purged
-- or gone from offload.yaml, leaves no key for ever
local cfg_ttl = math.max(tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])) + 86400000
redis.call('PEXPIRE', P .. 'history:cfg', fmt(cfg_ttl))
history_buckets(now, function(key, ttl)
  local wrote = false
  for i = 6, #ARGV, 2 do
    local field, value = 'g:' .. ARGV[i], tonumber(ARGV[i + 1])
    if value then
      local had = tonumber(redis.call('HGET', key, field))
      if not had or value > had then redis.call('HSET', key, field, ARGV[i + 1]) end
      wrote = true
    end
  end
  if wrote then redis.call('PEXPIRE', key, fmt(ttl)) end
end)
return now - now % 60000
