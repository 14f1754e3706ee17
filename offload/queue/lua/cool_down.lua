-- Extends a backend's cool-down to `ms` from now unless a longer one runs: one step, so two workers' 429s at
-- once can never shorten the longer pause.
-- KEYS: [1] the backend's cool-down key (offload.queue.keys.backend_cooldown)
-- ARGV: [1] ms
-- Returns: the cool-down's remaining ms
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) then
  redis.call('SET', KEYS[1], '1', 'PX', ARGV[1])
end
return redis.call('PTTL', KEYS[1])
