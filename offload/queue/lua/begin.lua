-- Run right before the provider call, per job, in one atomic step: the lease check (a stale worker must not pay),
-- the cancel check (a job cancelled while its worker waited on the rate limit is not submitted), the cap
-- reservation (over a cap the job is held, here, at once), and the submit intent: the submission number `sub_n`,
-- `intent_at` and `intent_by`, open until the checkpoint records the remote id. The submission number names the
-- remote run in the Idempotency-Key: it goes up only when a new run is wanted (the first submission, or after the
-- previous remote job failed, expired or timed out); an intent still open from an earlier lease means that
-- submission's outcome is unknown (its worker died or lost its lease inside the submit call), so it is submitted
-- again with the same number and counted as a possible duplicate. A repeat with the same token (a lost reply, or
-- another try after a 429) answers the same number again and counts nothing. A remote job recorded for the
-- current submission since the claim (a stale worker's answer, attached by checkpoint.lua, or adopted from its
-- webhook by hook.lua) is answered REMOTE: nothing is sent, the caller polls it. The hash of the submission's
-- webhook secret, when given, is kept per submission (`hook:<n>`, the last four: a resend of an unknown submission
-- under the same number carries a new secret, and the first one's webhook must still be recognised).
-- The backend a submission goes to is recorded with its intent (`backend`), before the call: a job whose submission
-- is of unknown outcome is sent again only there (never to another provider of a routed queue, which would pay
-- twice), and a worker asking for another is answered MOVED:<the recorded one>, opening nothing. A repeat with the
-- same token may name another backend (the first answered 429: nothing was accepted). `why`, when given, is the
-- router's reason, kept on the record (`routed`) and put on the events stream as a `routed` entry.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, job cap ('' none), spend cap ('' none), backend name, items: a JSON list of [id, token, estimated
--   cost, webhook secret hash ('' none), backend ('' or absent: ARGV's), why ('' or absent: none)]. The cap
--   window is the store's UTC day (`window_of` in clock.lua).
-- Returns: per item OK:<n>, OK:<n>:DUP, REMOTE:<n>:<remote id>, MOVED:<backend>, CAP:jobs, CAP:spend (held),
--   CANCEL, STALE or NOTFOUND
--- @include "clock"
--- @include "records"
--- @include "leases"
--- @include "caps"
--- @include "events"
--- @include "history"
local now = now_ms(ARGV[1])
local window, job_cap, spend_cap, backend = window_of(now), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local capped = job_cap or spend_cap
local st = nil
if capped then st = cap_open(window) end
local out, dups, calls = {}, 0, 0  -- calls: new submissions opened (provider calls, for the history)
local function routed(id, k, to, why)
  redis.call('HSET', k, 'routed', why)
  redis.call('XADD', P .. 'events', 'MAXLEN', '~', EVENTS_MAX, '*', 'state', 'routed', 'jobs', id, 'backend', to,
    'why', why)
end
local function remember_hook(k, n, digest)
  if digest == nil or digest == '' then return end
  local field = 'hook:' .. n
  local known = redis.call('HGET', k, field)
  if not known then
    redis.call('HSET', k, field, digest)
  elseif not string.find(known, digest, 1, true) then
    local kept = {}
    for h in string.gmatch(known, '%S+') do kept[#kept + 1] = h end
    while #kept >= 4 do table.remove(kept, 1) end
    kept[#kept + 1] = digest
    redis.call('HSET', k, field, table.concat(kept, ' '))
  end
end
for _, item in ipairs(cjson.decode(ARGV[5])) do
  local id, token, estimate, digest = item[1], item[2], tonumber(item[3]) or 0, item[4]
  local to, why = item[5], item[6]
  if to == nil or to == '' then to = backend end
  local k = jkey(id)
  -- the lease check of owned() (leases.lua) and the fields the intent needs, in one read: this runs per job
  local cancel, sub_n, sub_open, intent_tok, remote_n, resv_w, resv_n, remote_id, state, tok, owner, sent_to =
    unpack(redis.call('HMGET', k, 'cancel', 'sub_n', 'sub_open', 'intent_tok', 'remote_n', 'resv_w', 'resv_n',
      'remote_id', 'state', 'token', 'owner', 'backend'))
  if not state then
    out[#out + 1] = 'NOTFOUND'
  elseif tok ~= token or (state ~= 'active' and state ~= 'submitted') then
    out[#out + 1] = 'STALE'
  else
    local sub = tonumber(sub_n or '')
    if cancel == '1' then
      out[#out + 1] = 'CANCEL'
    elseif sub and remote_id and remote_id ~= '' and tonumber(remote_n or '') == sub then
      out[#out + 1] = 'REMOTE:' .. sub .. ':' .. remote_id  -- attached since the claim: poll it, pay nothing
    elseif sub and sub_open == '1' and intent_tok ~= token and sent_to and sent_to ~= '' and sent_to ~= to then
      out[#out + 1] = 'MOVED:' .. sent_to  -- unknown outcome at `sent_to`: settled there, never sent elsewhere
    elseif sub and sub_open == '1' and intent_tok == token then
      remember_hook(k, sub, digest)
      if to ~= sent_to then redis.call('HSET', k, 'backend', to) end  -- after a 429: nothing was accepted
      if why and why ~= '' then routed(id, k, to, why) end
      out[#out + 1] = 'OK:' .. sub
    else
      local n, dup = next_submission(sub_n, remote_n), false
      if sub and sub_open == '1' then n, dup = sub, true end  -- an earlier lease's intent, still open
      local verdict, counts = nil, false
      local again = dup or resv_w ~= window or tonumber(resv_n or '') ~= n
      if capped then verdict, counts = cap_take(st, id, estimate, job_cap, spend_cap, again) end
      if verdict then
        hold_job(id, owner, now, 'daily ' .. verdict .. ' cap reached (window ' .. window .. ')', window)
        out[#out + 1] = 'CAP:' .. verdict
      else
        redis.call('HSET', k, 'sub_n', n, 'sub_open', '1', 'intent_at', now, 'intent_by', owner, 'intent_tok', token,
          'backend', to)
        remember_hook(k, n, digest)
        if why and why ~= '' then routed(id, k, to, why) end
        if capped and again then
          redis.call('HSET', k, 'resv', estimate, 'resv_w', window, 'resv_n', n, 'resv_c', counts and '1' or '0')
        end
        calls = calls + 1
        if dup then
          redis.call('HINCRBY', k, 'possible_duplicates', 1)
          dups = dups + 1
          out[#out + 1] = 'OK:' .. n .. ':DUP'
        else
          out[#out + 1] = 'OK:' .. n
        end
      end
    end
  end
end
if st then cap_commit(st) end
if dups > 0 then redis.call('HINCRBY', P .. 'dups', backend, dups) end
history_add(now, {'provider_calls', calls})
return out
