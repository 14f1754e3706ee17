-- Leases: a worker's jobs hang off its liveness (the `workers` set, scored by the worker's lease deadline; its jobs
-- in `owned:<worker>`, scored by the lease's sequence number, the number in its token). A lease ends with a verdict,
-- held, handed back, or taken back when its worker is gone.
--- @include "records"
--- @include "events"
--- @include "metrics"
--- @include "ready"
--- @include "terminal"
--- @include "attempts"

-- A worker speaks (claim, heartbeat): its lease runs from now, and it may be excused an outage again.
local function heard(wid, now, lease)
  redis.call('ZADD', P .. 'workers', now + lease, wid)
  redis.call('SREM', P .. 'excused', wid)
end

-- Leave the active set: forget the leases everywhere they are indexed. owners: id -> owner.
local function unlease(ids, owners)
  if #ids == 0 then return end
  bulk('ZREM', P .. 'active', ids)
  if redis.call('SCARD', P .. 'submitted') > 0 then bulk('SREM', P .. 'submitted', ids) end
  if redis.call('SCARD', P .. 'cancelreq') > 0 then bulk('SREM', P .. 'cancelreq', ids) end
  local by_owner, counts = {}, {}
  for _, id in ipairs(ids) do
    local o = owners[id]
    if o and o ~= '' then
      local c = (counts[o] or 0) + 1
      if c == 1 then by_owner[o] = {} end
      by_owner[o][c] = id
      counts[o] = c
    end
  end
  for o, list in pairs(by_owner) do bulk('ZREM', P .. 'owned:' .. o, list) end
end

-- Check that `token` still owns job `id`: returns the leased job's {state, owner, retention, started_at, idem,
-- callback, backend ('' none)} (by name; `finish` takes it as the job's info) or nil and an error word.
local function owned(id, token)
  local state, tok, owner, retention, started_at, idem, callback, backend = unpack(redis.call('HMGET', jkey(id),
    'state', 'token', 'owner', 'retention', 'started_at', 'idem', 'callback', 'backend'))
  if not state then return nil, 'NOTFOUND' end
  if tok ~= token or (state ~= 'active' and state ~= 'submitted') then return nil, 'STALE' end
  return {state = state, owner = owner, retention = retention, started_at = started_at, idem = idem,
    callback = callback, backend = backend or ''}, nil
end

-- Held jobs are scored by the numeric cap window they wait out (20261130), so the jobs due for release
-- are one range query, and a big backlog held today costs nothing to skip.
local function hold_job(id, owner, now, reason, window)
  local k = jkey(id)
  unlease({id}, {[id] = owner})
  attempt_ended(id, now, 'held', reason)
  redis.call('HINCRBY', k, 'attempts', -1)
  redis.call('HSET', k, 'state', 'held', 'error', reason, 'held_at', now, 'owner', '', 'token', '',
    'held_window', window or '')
  redis.call('ZADD', P .. 'held', tonumber(window) or 0, id)
  event({id}, 'held')
end

-- The submission number a lease sends its job under when no intent of it is open (begin.lua, and claim.lua's
-- `begin`): 1 for the first; the next after a run whose remote id was recorded (`remote_n` = `sub_n`); else the
-- same number again (the last try was answered without a remote job: the same run is still wanted).
local function next_submission(sub_n, remote_n)
  local sub = tonumber(sub_n or '')
  if not sub then return 1 end
  if tonumber(remote_n or '') == sub then return sub + 1 end
  return sub
end

-- Leases that ended without a verdict (worker died or let go). The remote id is kept so the next worker
-- resumes polling; only a crash (counted=true) uses up one of the job's lease expiries. A remote id that a
-- `start` webhook recorded while this lease held the job (hook.lua's STARTED, `started_n`) and that the
-- worker never checkpointed itself (still `active`) was learnt from the provider alone: counted as adopted.
-- A cancelled job ends here only when nothing remote may run (no remote id, no intent left open); else it
-- goes back first in line, for the next worker to cancel the remote job (see cancel.lua).
local function return_leases(ids, now, counted)
  local back, dead, cancelled, leaving, owners = {}, {}, {}, {}, {}
  for _, id in ipairs(ids) do
    local k = jkey(id)
    local state, owner, expiries, max_attempts, cancel, remote_id, attempts, started_n, sub_open =
      unpack(redis.call('HMGET', k, 'state', 'owner', 'expiries', 'max_attempts', 'cancel', 'remote_id', 'attempts',
        'started_n', 'sub_open'))
    if not state then
      leaving[#leaving + 1] = id
    elseif state == 'active' or state == 'submitted' then
      leaving[#leaving + 1] = id
      owners[id] = owner
      if started_n then
        redis.call('HDEL', k, 'started_n')
        if state == 'active' then
          redis.call('HINCRBY', k, 'adopted', 1)
          count('adopted', 1)
        end
      end
      if counted then attempt_ended(id, now, 'lease lost', 'its worker stopped heartbeating')
      else attempt_ended(id, now, 'released') end
      local left = tonumber(attempts or 0) - 1
      local exp = tonumber(expiries or 0)
      if counted then exp = exp + 1 end
      redis.call('HSET', k, 'attempts', left, 'expiries', exp)
      if cancel == '1' and (not remote_id or remote_id == '') and sub_open ~= '1' then
        cancelled[#cancelled + 1] = id
      elseif exp > tonumber(max_attempts) then
        redis.call('HSET', k, 'attempts', left + 1)
        dead[#dead + 1] = id
      else
        back[#back + 1] = id
      end
    end
  end
  unlease(leaving, owners)
  finish(cancelled, 'cancelled', now, nil, nil)
  finish(dead, 'dead', now, 'lease expired', nil)
  make_ready(back, now, false)
  return #leaving
end

-- A worker that is gone: its leases (and the memory of its last claim) go.
local function forget_worker(wid)
  redis.call('DEL', P .. 'owned:' .. wid, P .. 'lastclaim:' .. wid)
  redis.call('ZREM', P .. 'workers', wid)
  redis.call('SREM', P .. 'excused', wid)
end

-- Take back the leases of workers whose lease deadline passed, up to `limit` workers.
local function reap(now, limit)
  local n = 0
  local gone = redis.call('ZRANGEBYSCORE', P .. 'workers', '-inf', now, 'LIMIT', 0, limit)
  for _, wid in ipairs(gone) do
    local ids = redis.call('ZRANGE', P .. 'owned:' .. wid, 0, -1)
    n = n + return_leases(ids, now, true)
    if #ids > 0 then  -- remembered a day: if the worker's machine was pre-empted, `forgive` refunds the expiries
      for _, id in ipairs(ids) do redis.call('HINCRBY', P .. 'lost:' .. wid, id, 1) end
      redis.call('EXPIRE', P .. 'lost:' .. wid, 86400)
    end
    forget_worker(wid)
  end
  return n
end
