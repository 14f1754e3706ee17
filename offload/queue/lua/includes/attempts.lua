-- A job's attempts, one per lease. The current one is the job's own record: its claim (started_at, token: claim.lua),
-- its submission (backend, remote_id, sub_n, submitted_at: checkpoint.lua, or complete.lua for a synchronous
-- answer; adopted_at: hook.lua) and, when it succeeds, its end (finished_at, cost, kind: complete.lua). A lease that
-- ends any other way (failed and retried, dead, cancelled, held, released, lost) is written here, into the hash
-- `att:<id>` beside the job (same hash slot), by the script that ends it, from those fields before they change: so
-- the path every job takes (claim, submit, succeed) writes nothing more. Fields: `n` (attempts written) and one
-- JSON record per attempt, by number. The first ATT_HEAD and the last ATT_TAIL are kept (a job retried for ever
-- costs at most 50 records). Read by offload/queue/attempts.py (story.lua); deleted with the job's hash (trim in
-- terminal.lua, purge.lua).
--- @include "records"
local ATT_HEAD, ATT_TAIL = 5, 45
local ATT_ERROR_MAX = 1000  -- an attempt's error is the job's error (already redacted, offload/redact.py), cut

local function att_key(id) return P .. 'att:' .. id end

-- The hash keys of the attempts of `ids`, appended to `keys` (for a DEL of the jobs' records).
local function attempt_keys(ids, keys)
  local n = #keys
  for i, id in ipairs(ids) do keys[n + i] = att_key(id) end
  return keys
end

-- The job's current lease ends, other than by success: its record is written from the job's fields. `outcome`:
-- failed (retried), dead, cancelled, held, released or lease lost; `cost` (a number or nil) what this run cost,
-- `kind` its capacity. How its end was learnt: from its GPU worker (fleet), the provider's final webhook for this
-- submission (hook.lua's `hook_n`), else a poll; none without a remote job recorded for the submission.
local function attempt_ended(id, now, outcome, err, cost, kind)
  local started_at, token, backend, remote_id, sub_n, remote_n, submitted_at, adopted_at, hook_n =
    unpack(redis.call('HMGET', jkey(id), 'started_at', 'token', 'backend', 'remote_id', 'sub_n', 'remote_n',
      'submitted_at', 'adopted_at', 'hook_n'))
  if not started_at or not token or token == '' then return end
  local rec = {claimed_at = tonumber(started_at), token = token, ended_at = now, outcome = outcome, kind = kind}
  if backend and backend ~= '' then rec.backend = backend end
  local remote = remote_id and remote_id ~= '' and remote_n == sub_n
  if remote then
    rec.remote_id, rec.sub = remote_id, tonumber(sub_n)
    -- adopted: learnt from the provider's webhook during this lease, never checkpointed by it (a `start`
    -- webhook is no adoption). Else the remote job is this lease's own (checkpointed since its claim) or an
    -- earlier lease's, checkpointed or adopted: the later of the two times (before the claim: resumed).
    local adopted, submitted = tonumber(adopted_at or ''), tonumber(submitted_at or '')
    local own = submitted and submitted >= rec.claimed_at
    if adopted and adopted >= rec.claimed_at and not own then rec.adopted, rec.submitted_at = true, adopted
    elseif own or not adopted then rec.submitted_at = submitted
    else rec.submitted_at = math.max(adopted, submitted or 0) end
  end
  if kind == 'fleet' then rec.learned = 'worker'
  elseif remote and hook_n == sub_n then rec.learned = 'webhook'
  elseif remote then rec.learned = 'poll' end
  if err and err ~= '' then rec.error = string.sub(err, 1, ATT_ERROR_MAX) end
  rec.cost = cost
  local key = att_key(id)
  local n = redis.call('HINCRBY', key, 'n', 1)
  redis.call('HSET', key, n, cjson.encode(rec))
  local drop = n - ATT_TAIL
  if drop > ATT_HEAD then redis.call('HDEL', key, drop) end
end
