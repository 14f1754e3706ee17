#!lua flags=allow-oom
-- One call extends every lease of the worker (leases hang off the worker's liveness, not each job). A listed
-- lease is lost when the worker no longer owns the job or owns it under another token (it was taken away and
-- claimed again since). Jobs the worker owns but does not list are leases it does not know of (a claim whose
-- reply never arrived, a predecessor with the same worker id, a task that ended without a verdict): they are
-- handed back, uncounted, when their lease is no newer than `since` (a lease sequence number the worker had seen
-- before it sent this heartbeat: every claim it was answered up to then is in its list) or, with `grace`, when
-- they were claimed more than `grace` ms ago (for workers that cannot tell).
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, worker id, lease ms, silence ms, since, grace ms, then (job id, lease token) pairs: the leases the
--   worker holds (a token '' is judged by ownership alone)
-- Returns: {lost ids, cancel-requested ids, the lease sequence number now, how many were handed back, the ms the
--   store's clock stepped back since a heartbeat or maintenance pass last said so (0: none; `shift_back` in
--   outages.lua)}
--- @include "clock"
--- @include "records"
--- @include "leases"
--- @include "outages"
local now = now_ms(ARGV[1])
local wid, lease, silence = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local since, grace = tonumber(ARGV[5]), tonumber(ARGV[6])
local owned_key = P .. 'owned:' .. wid
local _, stepped = stamp(now, silence, true)
heard(wid, now, lease)
reap(now, 100)
local lost, cancels, listed, n_listed = {}, {}, {}, 0
local any_cancel = redis.call('SCARD', P .. 'cancelreq') > 0
local PAIRS = 3999  -- ids per command: under the limit of unpack()
for i = 7, #ARGV, 2 * PAIRS do
  local ids, toks = {}, {}
  for j = i, math.min(i + 2 * PAIRS - 1, #ARGV), 2 do
    ids[#ids + 1] = ARGV[j]
    toks[#toks + 1] = ARGV[j + 1] or ''
  end
  -- ZMSCORE answers for a whole chunk of ids in one command: verifying 10,000 leases stays a few calls.
  local seqs = redis.call('ZMSCORE', owned_key, unpack(ids))
  local flagged = {}
  if any_cancel then flagged = redis.call('SMISMEMBER', P .. 'cancelreq', unpack(ids)) end
  for j, id in ipairs(ids) do
    local s, t = seqs[j], toks[j]
    if not s or (t ~= '' and t ~= wid .. '/' .. s) then
      lost[#lost + 1] = id
    else
      if not listed[id] then n_listed = n_listed + 1 end
      listed[id] = true
      if flagged[j] == 1 then cancels[#cancels + 1] = id end
    end
  end
end
local released = 0
if (since or grace) and redis.call('ZCARD', owned_key) > n_listed then
  local candidates
  if since then
    candidates = redis.call('ZRANGEBYSCORE', owned_key, '-inf', since)
  else
    candidates = redis.call('ZRANGE', owned_key, 0, -1)
  end
  local unknown = {}
  for _, id in ipairs(candidates) do
    if not listed[id] then
      if not grace or now - tonumber(redis.call('HGET', jkey(id), 'started_at') or now) > grace then
        unknown[#unknown + 1] = id
      end
    end
  end
  released = return_leases(unknown, now, false)
  bulk('ZREM', owned_key, unknown)  -- also the entries of records that are gone or moved on
end
return {lost, cancels, redis.call('GET', P .. 'tok') or '0', released, stepped}
