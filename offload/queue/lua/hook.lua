-- A provider webhook whose URL secret the server has already checked (against `hook:<n>`). Fenced by the
-- submission number: only the job's current submission counts, so a late callback of an earlier run can never
-- complete a newer one. It records the remote id when that submission has none (its worker died inside the
-- submit call: adoption), for a non-final event (Replicate's `start`, sent the moment the prediction exists) as
-- for a final one, so the double-pay window closes within a webhook's round trip instead of at the remote job's
-- end. Recorded while the worker that opened the intent still holds the lease, the id is STARTED (that worker
-- may still get the same id as its answer; its checkpoint then agrees), counted as adopted only if that lease
-- ends without the worker recording it (leases.lua's return_leases); recorded for a job already
-- handed to another worker (waiting out the grace in `Polling.await_hook`), it is ADOPTED, counted, and that worker is
-- told (PUBLISH). Either way an `adopted` event is written, so the fault harness knows when the id was known. A
-- non-final body is never kept and wakes nobody else (the worker polls no sooner). A final event keeps the body
-- (`hook_n`, `hook_body`) and tells the worker holding the lease (PUBLISH on its channel: `<id> <n>`, followed by
-- ` <body>` when the body is at most INLINE bytes, so that worker stores the result without reading it back; a
-- larger one is read from the record, which keeps a burst's messages within the subscriber's output buffer); a
-- job nobody holds is resumed by its next claim, which finds the remote id and the body.
-- Duplicates, late and reordered deliveries (a `start` after `completed`) change nothing, as does a callback of
-- a run already given up (its remote id let go).
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, job id, submission number, remote id ('' unknown), terminal ('1' / '0'), body
-- Returns: WAKE (final event kept, owner told), KEPT (final event kept, nobody holds the job), ADOPTED (the id
--   recorded for a re-delivered job) / STARTED (recorded while its submitter holds the lease) / OK (not final,
--   nothing new), DUP, LATE (the job is finished), STALE (an earlier submission), MISMATCH (another remote id
--   than the one recorded for this submission), NOTFOUND.
--- @include "clock"
--- @include "records"
--- @include "events"
--- @include "metrics"
local now = now_ms(ARGV[1])
local id, n, remote, terminal, body = ARGV[2], tonumber(ARGV[3]), ARGV[4], ARGV[5] == '1', ARGV[6]
local k = jkey(id)
local state, sub_n, remote_n, recorded, hook_n, owner, sub_open, token, intent_tok =
  unpack(redis.call('HMGET', k, 'state', 'sub_n', 'remote_n', 'remote_id', 'hook_n', 'owner', 'sub_open', 'token',
    'intent_tok'))
if not state then return 'NOTFOUND' end
if TERMINAL[state] then return 'LATE' end
if tonumber(sub_n or '') ~= n then return 'STALE' end
local verdict = 'OK'
if tonumber(remote_n or '') == n and recorded and recorded ~= '' then
  if remote ~= '' and recorded ~= remote then return 'MISMATCH' end
elseif sub_open ~= '1' then
  -- no remote job recorded and no intent open: this run is over (it failed or expired and its remote id was
  -- let go, or the provider refused the submit); a late callback of it must not bring its remote id back
  return 'STALE'
elseif remote ~= '' then
  redis.call('HSET', k, 'remote_id', remote, 'remote_n', n, 'sub_open', '0', 'adopted_at', now)
  event({id}, 'adopted')
  local submitter = token and token ~= '' and token == intent_tok
  if terminal or not submitter then
    redis.call('HINCRBY', k, 'adopted', 1)
    count('adopted', 1)
    verdict = 'ADOPTED'
    if not terminal and owner and owner ~= '' then redis.call('PUBLISH', P .. 'hooks:' .. owner, id .. ' ' .. n) end
  else
    redis.call('HSET', k, 'started_n', n)  -- counted as adopted if this lease ends unrecorded (return_leases)
    verdict = 'STARTED'
  end
end
if not terminal then return verdict end
if tonumber(hook_n or '') == n then return 'DUP' end
redis.call('HSET', k, 'hook_n', n, 'hook_body', body, 'hook_at', now)
if (state == 'active' or state == 'submitted') and owner and owner ~= '' then
  local INLINE = 4096
  local told = id .. ' ' .. n
  if #body <= INLINE then told = told .. ' ' .. body end
  redis.call('PUBLISH', P .. 'hooks:' .. owner, told)
  return 'WAKE'
end
return 'KEPT'
