-- Counts a failed authentication in a fixed window (the HTTP server's brute-force guard, one counter per client
-- address and one per presented key id): the window starts at the first failure, so the count and its expiry
-- are set in one step.
-- KEYS: [1] the failure counter (offload.queue.keyspace.auth_failures or auth_key_failures)
-- ARGV: [1] the window in ms
-- Returns: {failures in the current window (this one included), ms left in the window}
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
local left = redis.call('PTTL', KEYS[1])
if left < 0 then  -- a counter left without expiry (written by hand): give it one rather than block forever
  redis.call('PEXPIRE', KEYS[1], ARGV[1])
  left = tonumber(ARGV[1])
end
return {n, left}
