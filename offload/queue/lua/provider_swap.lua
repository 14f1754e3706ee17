-- Rewrites a provider's sealed secrets read in an older vault format, unless they changed meanwhile (another
-- server saved new ones: those win).
-- KEYS: [1] the provider's hash (offload.autoscale.keyspace.provider)
-- ARGV: [1] the sealed secrets as read, [2] the same secrets sealed in the current format
-- Returns: 1 when they were rewritten, 0 when they had changed
if redis.call('HGET', KEYS[1], 'secrets') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'secrets', ARGV[2])
  return 1
end
return 0
