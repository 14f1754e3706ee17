-- Leases up to `max jobs` ready jobs to a worker. Claiming also proves the worker alive, promotes due delayed
-- jobs, returns the jobs of dead workers to ready and deletes expired records (a bounded amount of each, the
-- trimming in step with the claiming), so a queue that has workers needs no separate scheduler to make progress.
-- Over a cap (in the cap window: the store's UTC day, `window_of` in clock.lua) no fresh job is taken: only jobs
-- that go on without a new submission (a remote job to resume, a cancel to carry out; under the job cap, a job
-- already counted in the window), from the head of the ready set.
-- A repeat of the worker's last claim (same request id: its reply was lost and the client sent it again) answers
-- the same jobs again instead of leasing more.
-- A claim that empties the ready set leaves `idle` behind: the next script that makes a job ready PUBLISHes on
-- `wake` (ready.lua), so an idle worker claims the moment work comes instead of at its next poll.
-- With `begin` ('1'), the claim also opens the submit intent of each fresh job, as begin.lua would right after it
-- (a worker on a synchronous API without caps begins every job the moment it has it: one round trip less per
-- job). Only a job with nothing unsettled is begun here: no remote id, no open intent, no cancel, and no cap
-- in the window (caps reserve in begin.lua); the others are left to begin.lua, which decides them.
-- A job past its deadline (epoch ms, the store's clock) is not leased: it goes dead with `deadline passed`
-- (counted as `deadline_passed`, and an event of that name), unless it may be running already (a remote id,
-- an intent open) or waits for its cancel: a job running at its deadline is not stopped.
-- A queue served by GPU workers and serverless overflow: the claimant's `mode` says which kind it is and pick.lua
-- which jobs each takes ('fleet': a GPU worker, never a job a dispatch worker may have sent; 'overflow': its
-- dispatch worker, only jobs the fleet will not start within `after`). '' takes the head, as any other queue.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, worker id, max jobs, lease ms, request id, job cap, spend cap, estimated cost of one submission,
--   silence ms, begin ('1' or ''), mode ('', 'fleet' or 'overflow'), after ms (overflow: the configured `after`,
--   used while the autoscaler's estimate has none)
-- Returns: a flat list, 15 fields per job (decoded in one place: offload.queue.replies): id, token, attempt,
--   max_attempts, input, output_key, backend, remote_id, cancel, claimed before (1/0), submission number,
--   submit intent open (1/0: an earlier delivery may have left a submission it never recorded), begun (1/0: the
--   intent of the submission number is this lease's own, opened by this claim), max cost (USD, '' none), deadline
--   (epoch ms, '' none: a routed queue's expected finish is compared with it)
--- @include "clock"
--- @include "records"
--- @include "events"
--- @include "metrics"
--- @include "ready"
--- @include "terminal"
--- @include "leases"
--- @include "caps"
--- @include "outages"
--- @include "pick"
--- @include "history"
local now = now_ms(ARGV[1])
local wid, n, lease, req = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local job_cap, spend_cap, estimate, silence = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8]) or 0,
  tonumber(ARGV[9])
local window = (job_cap or spend_cap) and window_of(now) or ''
local begin = ARGV[10] == '1' and window == ''
local begun = 0  -- intents opened here: provider calls, for the history
local mode, after_ms = ARGV[11] or '', tonumber(ARGV[12]) or 0
local FIELDS = {'max_attempts', 'attempts', 'remote_id', 'input', 'output_key', 'backend', 'cancel',
  'started_at', 'ready_at', 'created_at', 'sub_n', 'sub_open', 'token', 'intent_tok', 'remote_n', 'deadline',
  'max_cost'}
stamp(now, silence)
heard(wid, now, lease)
local last_key = P .. 'lastclaim:' .. wid

-- Appends one job's reply fields at `no` (the count so far; a running count, as `#out` is a search each time)
-- and returns the new count. `open`: its submission's intent is open; `own`: this lease opened it.
local function reply(out, no, id, token, before, attempt, max_attempts, input, output_key, backend, remote_id, cancel,
    sub_n, open, own, max_cost, deadline)
  out[no + 1] = id
  out[no + 2] = token
  out[no + 3] = attempt
  out[no + 4] = max_attempts
  out[no + 5] = input
  out[no + 6] = output_key or ('results/' .. id .. '.json')
  out[no + 7] = backend or ''
  out[no + 8] = remote_id or ''
  out[no + 9] = cancel or '0'
  out[no + 10] = before
  out[no + 11] = sub_n or '0'
  out[no + 12] = (open and not own) and '1' or '0'
  out[no + 13] = (open and own) and '1' or '0'
  out[no + 14] = max_cost or ''
  out[no + 15] = deadline or ''
  return no + 15
end

if req ~= '' then
  local last = redis.call('GET', last_key)
  if last then
    local memo_req, memo_ids, memo_flags = unpack(cjson.decode(last))  -- as written below: {req, ids, flags}
    if memo_req == req then
      local out, no = {}, 0
      for i, id in ipairs(memo_ids) do
        local max_attempts, attempts, remote_id, input, output_key, backend, cancel, _, _, _, sub_n, sub_open, token,
          intent_tok, _, deadline, max_cost = unpack(redis.call('HMGET', jkey(id), unpack(FIELDS)))
        if max_attempts and (token or '') ~= '' and redis.call('ZSCORE', P .. 'owned:' .. wid, id) then
          no = reply(out, no, id, token, memo_flags[i], tonumber(attempts or 0), max_attempts, input, output_key, backend,
            remote_id, cancel, sub_n, sub_open == '1', intent_tok == token, max_cost, deadline)
        end
      end
      return out
    end
  end
end

promote(now, 1000)
reap(now, 100)
trim(now, 100 + 2 * n)
if n <= 0 or redis.call('EXISTS', P .. 'paused') == 1 then return {} end
local picked
local capped = cap_reached(window, job_cap, spend_cap, estimate)
if capped or mode ~= '' then
  local counted = capped and cap_base(window) .. 'counted'
  -- over a cap only what takes no new submission: a remote job to resume, a cancel to carry out, a counted job
  local function allowed(id, remote_id, cancel)
    return not capped or (remote_id or '') ~= '' or cancel == '1'
      or (capped == 'jobs' and redis.call('SISMEMBER', counted, id) == 1)
  end
  picked = pick(mode, n, now, after_ms, allowed)
  bulk('ZREM', P .. 'ready', picked)
  -- a fleet that found too little may be woken by new work; overflow's share grows with time, not arrivals
  if mode == 'fleet' and not capped and #picked < n then redis.call('SET', P .. 'idle', '1', 'PX', 600000) end
else
  picked = {}
  local popped = redis.call('ZPOPMIN', P .. 'ready', n)
  for j = 1, #popped, 2 do picked[#picked + 1] = popped[j] end
  -- the ready set ran dry: the next job made ready wakes the idle workers (ready.lua's `wake`). Not under a
  -- cap or a pause, whose claims take nothing however many jobs come: each would be a wake-up for nothing.
  if #picked < n then redis.call('SET', P .. 'idle', '1', 'PX', 600000) end
end
if #picked == 0 then return {} end
local out, ids, active, owned, submitted, cancels, waits, flags, late = {}, {}, {}, {}, {}, {}, {}, {}, {}
local no, taken = 0, 0  -- running counts: the reply's fields, the jobs leased
local base = redis.call('INCRBY', P .. 'tok', #picked) - #picked
for _, id in ipairs(picked) do
  local k = jkey(id)
  local max_attempts, attempts, remote_id, input, output_key, backend, cancel, started_at, ready_at, created_at, sub_n,
    sub_open, _, intent_tok, remote_n, deadline, max_cost = unpack(redis.call('HMGET', k, unpack(FIELDS)))
  if max_attempts and deadline and now >= tonumber(deadline) and (remote_id or '') == '' and sub_open ~= '1'
      and cancel ~= '1' then
    late[#late + 1] = id
  elseif max_attempts then
    base = base + 1
    local token = wid .. '/' .. base
    local attempt = tonumber(attempts or 0) + 1
    local state = 'active'
    if remote_id and remote_id ~= '' then
      state = 'submitted'
      submitted[#submitted + 1] = id
    end
    if begin and state == 'active' and sub_open ~= '1' and cancel ~= '1' then  -- the intent begin.lua would open
      local n = next_submission(sub_n, remote_n)
      redis.call('HSET', k, 'state', state, 'owner', wid, 'token', token, 'started_at', now, 'attempts', attempt,
        'sub_n', n, 'sub_open', '1', 'intent_at', now, 'intent_by', wid, 'intent_tok', token)
      sub_n, sub_open, intent_tok = tostring(n), '1', token
      begun = begun + 1
    else
      redis.call('HSET', k, 'state', state, 'owner', wid, 'token', token, 'started_at', now, 'attempts', attempt)
    end
    taken = taken + 1
    ids[taken] = id
    active[2 * taken - 1] = now
    active[2 * taken] = id
    owned[2 * taken - 1] = base
    owned[2 * taken] = id
    if cancel == '1' then cancels[#cancels + 1] = id end
    waits[taken] = now - tonumber(ready_at or created_at or now)
    local before = started_at and '1' or '0'
    flags[taken] = before
    no = reply(out, no, id, token, before, attempt, max_attempts, input, output_key, backend, remote_id, cancel, sub_n,
      sub_open == '1', intent_tok == token, max_cost, deadline)
  end
end
bulk_zadd(P .. 'active', active)
bulk_zadd(P .. 'owned:' .. wid, owned)
bulk('SADD', P .. 'submitted', submitted)
bulk('SADD', P .. 'cancelreq', cancels)
if req ~= '' then
  redis.call('SET', last_key, cjson.encode({req, ids, flags}), 'PX', math.max(lease * 3, 1000))
end
event(ids, 'active')
history_hist(now, 'wait', observe('wait', waits))
history_add(now, {'provider_calls', begun})
deadline_passed(late, now)
return out
