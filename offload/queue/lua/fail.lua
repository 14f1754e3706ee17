#!lua flags=allow-oom
-- A retry is scheduled in Redis (the worker never sleeps); exhausted or fatal goes dead with the reason.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, id, token, error, retryable (1/0), delay ms, keep remote id (1/0), submit answered (1/0: the
--   provider answered the submit, so the submit intent is closed), cost of the failed run ('' unknown), refund
--   (1/0: the provider refused the submission, nothing ran: the job is not counted against the caps), duplicate
--   (1/0: a retry's next run is paid for while this one may still run, e.g. resubmit_on_timeout without a
--   cancel: counted as a possible duplicate, on the job and per backend, when the job is retried), returned
--   (1/0: the job never ran and comes back unsent, e.g. a batch line expired or cancelled before it ran: its
--   attempt is given back, as a release or a hold gives it back, so returns alone never exhaust max_attempts),
--   kind ('' or absent: serverless; fleet: a GPU worker through the server), the GPU worker's machine price per
--   hour (fleet only; '' unknown)
-- A run that cost something (a known cost, or a fleet run's share of its machine) records its kind on the job and
-- adds to the queue's spend of that kind (spend.lua); the job's `cost` stays the cost of the run that succeeds.
-- A retry that would come due at or after the job's deadline is not scheduled: the job goes dead with
-- `deadline passed` (terminal.lua's `deadline_passed`), its last error kept after it.
-- An error starting `over max_cost:` (worker/budget.py) is counted and evented as `over_max_cost` too.
-- Returns: retrying, dead, STALE or NOTFOUND
--- @include "clock"
--- @include "records"
--- @include "events"
--- @include "metrics"
--- @include "terminal"
--- @include "leases"
--- @include "caps"
--- @include "outages"
--- @include "spend"
--- @include "history"
--- @include "attempts"
local now = now_ms(ARGV[1])
rewind(now)  -- before a retry is scheduled on the store's clock
local id, token, err_text = ARGV[2], ARGV[3], ARGV[4]
local job, err = owned(id, token)
if err then return err end
local k = jkey(id)
unlease({id}, {[id] = job.owner})
count('failed', 1)
if ARGV[8] == '1' then redis.call('HSET', k, 'sub_open', '0') end
settle(k, id, tonumber(ARGV[9] or ''), ARGV[10] == '1')
local kind = ARGV[13] or ''
if kind == '' then kind = 'serverless' end
local paid = run_cost(kind, tonumber(ARGV[9] or ''), tonumber(ARGV[14] or ''), job.started_at, now)
if paid or kind == 'fleet' then redis.call('HSET', k, 'kind', kind) end
spend_add(kind, paid, now, job.backend ~= '' and {[job.backend] = paid} or {})
-- a failed run at a provider (not one that came back unsent) is a provider error in the history
if job.backend ~= '' and ARGV[12] ~= '1' then history_add(now, {'provider_errors', 1}) end
if ARGV[12] == '1' and ARGV[5] == '1' then redis.call('HINCRBY', k, 'attempts', -1) end
local attempts, max_attempts, deadline = unpack(redis.call('HMGET', k, 'attempts', 'max_attempts', 'deadline'))
local at = now + tonumber(ARGV[6])
if ARGV[5] == '1' and tonumber(attempts) < tonumber(max_attempts) and deadline and at >= tonumber(deadline) then
  attempt_ended(id, now, 'dead', err_text, paid, kind)
  deadline_passed({id}, now, {'deadline passed before the retry; last error: ' .. err_text})
  return 'dead'
end
if ARGV[5] == '1' and tonumber(attempts) < tonumber(max_attempts) then
  attempt_ended(id, now, 'failed', err_text, paid, kind)  -- before the retry lets the remote id go
  redis.call('HSET', k, 'state', 'retrying', 'error', err_text, 'run_at', at, 'owner', '', 'token', '')
  if ARGV[11] == '1' then
    redis.call('HINCRBY', k, 'possible_duplicates', 1)
    local backend = redis.call('HGET', k, 'backend')
    if backend and backend ~= '' then redis.call('HINCRBY', P .. 'dups', backend, 1) end
  end
  if ARGV[7] ~= '1' then
    -- an intent still open keeps its backend: that submission's outcome is settled there, never elsewhere
    if redis.call('HGET', k, 'sub_open') == '1' then redis.call('HDEL', k, 'remote_id')
    else redis.call('HDEL', k, 'backend', 'remote_id') end
  end
  redis.call('ZADD', P .. 'retry', at, id)
  history_add(now, {'failed', 1})
  event({id}, 'retrying')
  return 'retrying'
end
attempt_ended(id, now, 'dead', err_text, paid, kind)
finish({id}, 'dead', now, err_text, {job})
if string.sub(err_text, 1, 14) == 'over max_cost:' then  -- worker/budget.py: refused unsent, a kind of its own
  count('over_max_cost', 1)
  event({id}, 'over_max_cost')
end
return 'dead'
