-- Counts a failed authentication of one client address in a fixed window (the HTTP server's brute-force
-- guard): the window starts at the first failure, so the count and its expiry are set in one step.
-- KEYS: [1] the address's failure counter (offload.queue.keys.auth_failures)
-- ARGV: [1] the window in ms
-- Returns: the number of failures in the current window, this one included
local n = redis.call('INCR', KEYS[1])
if n == 1 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return n
