#!lua flags=allow-oom
-- A draining worker lets go of jobs it will not finish; they go back to ready with their remote id, without
-- counting as a lease expiry. Modes: 'all' (every lease of the worker, and the worker itself is forgotten), 'ids'
-- (the given ones), 'idle' (the given ones, then the worker is forgotten if it holds nothing else).
-- Intents the worker opened but never sent (begun, then drained before the call) are closed first, when the
-- intent is still that lease's: the submission is then sent again as the same run, not as a possible duplicate,
-- and the caps' reservation of that submission is refunded (nothing ran: the job is counted in the window it is
-- sent in, and the window it was begun in keeps the place for another job).
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, worker id, mode, unsent: a JSON list of [id, token] ('' none), then ids
-- Returns: the number of jobs released
--- @include "clock"
--- @include "records"
--- @include "leases"
--- @include "caps"
local now = now_ms(ARGV[1])
local wid, mode = ARGV[2], ARGV[3]
local owned_key = P .. 'owned:' .. wid
if ARGV[4] ~= '' then
  for _, item in ipairs(cjson.decode(ARGV[4])) do close_unsent(jkey(item[1]), item[1], item[2]) end
end
local ids = {}
if mode == 'all' then
  ids = redis.call('ZRANGE', owned_key, 0, -1)
else
  for i = 5, #ARGV do
    if redis.call('ZSCORE', owned_key, ARGV[i]) then ids[#ids + 1] = ARGV[i] end
  end
end
local n = return_leases(ids, now, false)
if mode == 'all' or (mode == 'idle' and redis.call('ZCARD', owned_key) == 0) then forget_worker(wid) end
return n
