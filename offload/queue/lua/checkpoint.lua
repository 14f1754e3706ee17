#!lua flags=allow-oom
-- Records where each job runs BEFORE the worker polls it, so a re-delivered job is resumed instead of submitted
-- (and paid for) again, and closes the submit intent of that submission. Batched: a worker with thousands of
-- submissions in flight records them in a few calls, not one round trip each.
-- A remote id is never thrown away while it can still serve its job: a worker whose lease lapsed while its
-- submit call was out (a SIGSTOP, a starved process) still reports the answer, and when the job is not terminal
-- and that submission has no remote id yet, the id is ATTACHED to the job (the next owner polls it instead of
-- paying again: begin.lua answers REMOTE). A second remote id for a submission that already has one (a provider
-- that ignored the Idempotency-Key ran it twice) is refused with the first id, so the caller cancels its own
-- copy: DUP:<first> to the owner (which goes on with the first), STALE:DUP to a stale worker. Attach and DUP
-- need the caller's submission number (the dispatch worker always sends it). An attach is an `attached` event:
-- the job's history shows where its remote id came from.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, items: a JSON list of [id, token, backend, remote id, submission number (optional: the job's
--   current one)]
-- Returns: per item OK, OK:CANCEL (a cancel was requested meanwhile), DUP:<first id>, ATTACHED, STALE:DUP,
--   STALE or NOTFOUND
--- @include "clock"
--- @include "records"
--- @include "events"
--- @include "leases"
local now = now_ms(ARGV[1])
local out, ids, attached = {}, {}, {}
local cancels = redis.call('SCARD', P .. 'cancelreq') > 0
for _, item in ipairs(cjson.decode(ARGV[2])) do
  local id, token, backend, remote_id, given_n = unpack(item)
  local _, err = owned(id, token)
  local k = jkey(id)
  local state, sub_n, remote_n, recorded = unpack(redis.call('HMGET', k, 'state', 'sub_n', 'remote_n', 'remote_id'))
  local n = tonumber(given_n) or tonumber(sub_n or '') or 1
  -- attach and DUP need the caller's submission number (the dispatch worker always sends it)
  local first = (given_n and tonumber(remote_n or '') == n and recorded and recorded ~= '') and recorded or nil
  if first and first ~= remote_id then
    out[#out + 1] = err and (err == 'STALE' and 'STALE:DUP' or err) or ('DUP:' .. first)
  elseif err then
    if err == 'STALE' and given_n and not first and tonumber(sub_n or '') == n and not TERMINAL[state] then
      redis.call('HSET', k, 'backend', backend, 'remote_id', remote_id, 'remote_n', n, 'sub_open', '0')
      attached[#attached + 1] = id
      out[#out + 1] = 'ATTACHED'
    else
      out[#out + 1] = err
    end
  else
    redis.call('HSET', k, 'state', 'submitted', 'backend', backend, 'remote_id', remote_id, 'submitted_at', now,
      'sub_n', n, 'remote_n', n, 'sub_open', '0')
    ids[#ids + 1] = id
    if cancels and redis.call('SISMEMBER', P .. 'cancelreq', id) == 1 then
      out[#out + 1] = 'OK:CANCEL'
    else
      out[#out + 1] = 'OK'
    end
  end
end
bulk('SADD', P .. 'submitted', ids)
event(ids, 'submitted')
event(attached, 'attached')
return out
