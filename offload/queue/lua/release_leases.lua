-- A draining worker lets go of jobs it will not finish; they go back to ready with their remote id, without
-- counting as a lease expiry. Modes: 'all' (every lease of the worker, and the worker itself is forgotten), 'ids'
-- (the given ones), 'idle' (the given ones, then the worker is forgotten if it holds nothing else).
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keys.py)
-- ARGV: now, worker id, mode, then ids
-- Returns: the number of jobs released
--- @include "common"
local now = now_ms(ARGV[1])
local wid, mode = ARGV[2], ARGV[3]
local owned_key = P .. 'owned:' .. wid
local ids = {}
if mode == 'all' then
  ids = redis.call('ZRANGE', owned_key, 0, -1)
else
  for i = 4, #ARGV do
    if redis.call('ZSCORE', owned_key, ARGV[i]) then ids[#ids + 1] = ARGV[i] end
  end
end
local n = return_leases(ids, now, false)
if mode == 'all' or (mode == 'idle' and redis.call('ZCARD', owned_key) == 0) then forget_worker(wid) end
return n
