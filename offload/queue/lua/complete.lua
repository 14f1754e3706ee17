#!lua flags=allow-oom
-- Batched so a worker acks many jobs in one round trip. A repeat of a complete that already went through (its
-- reply was lost and the client retried) answers OK again instead of STALE. A known cost settles the job's cap
-- reservation (the real cost replaces the worst case) in the same step. A run that was never checkpointed (a
-- synchronous API's answer) is recorded by the ack itself. Each job records its kind of capacity and what its run
-- cost (spend.lua), added to the queue's spend of that kind in the same step.
-- KEYS: [1] the queue's key prefix, offload:{<queue>}: (see offload/queue/keyspace.py)
-- ARGV: now, items: a JSON list of [id, token, result location, cost or ""(, backend, remote id, submission
--   number)], kind ('' or absent: serverless, a dispatch worker; fleet: a GPU worker through the server), the
--   GPU worker's machine price per hour (fleet only; '' or absent: unknown, the cost is not recorded)
-- Returns: per job OK, STALE or NOTFOUND
--- @include "clock"
--- @include "records"
--- @include "metrics"
--- @include "terminal"
--- @include "leases"
--- @include "caps"
--- @include "spend"
--- @include "history"
local now = now_ms(ARGV[1])
local kind, price_h = ARGV[3] or '', tonumber(ARGV[4] or '')
if kind == '' then kind = 'serverless' end
local paid_sum, by_backend = 0, {}
local out, done, owners, infos, extra, seen, runs = {}, {}, {}, {}, {}, {}, {}
local nd = 0  -- jobs completed so far (a running count: `#t` is a search each time)
for i, item in ipairs(cjson.decode(ARGV[2])) do
  local id, token, result, cost, backend, remote_id, sub_n = unpack(item)
  local job, err = nil, nil
  if seen[id] then  -- the same job twice in one batch: the first item decided it
    if seen[id] == token then err = 'REPEAT' else err = 'STALE' end
  else
    job, err = owned(id, token)
  end
  if err == 'REPEAT' then
    out[i] = 'OK'
  elseif err == 'STALE' and redis.call('HGET', jkey(id), 'state') == 'succeeded'
      and redis.call('HGET', jkey(id), 'token') == token then
    out[i] = 'OK'
  elseif err then
    out[i] = err
  else
    local fields = {'result', result, 'kind', kind}
    if cost ~= '' then settle(jkey(id), id, tonumber(cost), false) end
    local paid = run_cost(kind, tonumber(cost), price_h, job.started_at, now)
    if paid then
      fields[5], fields[6] = 'cost', kind == 'fleet' and fmt_cost(paid) or cost
      paid_sum = paid_sum + paid
      local at = backend or job.backend
      if at ~= '' then by_backend[at] = (by_backend[at] or 0) + paid end
    end
    if remote_id then  -- a run never checkpointed: record it and close its submit intent (as checkpoint.lua would)
      local m = #fields
      fields[m + 1], fields[m + 2], fields[m + 3], fields[m + 4] = 'backend', backend, 'remote_id', remote_id
      fields[m + 5], fields[m + 6], fields[m + 7], fields[m + 8] = 'submitted_at', now, 'sub_n', sub_n
      fields[m + 9], fields[m + 10], fields[m + 11], fields[m + 12] = 'remote_n', sub_n, 'sub_open', '0'
    end
    nd = nd + 1
    extra[nd] = fields
    done[nd] = id
    seen[id] = token
    owners[id] = job.owner
    infos[nd] = job  -- its retention and idempotency key, for finish()
    runs[nd] = now - tonumber(job.started_at or now)
    out[i] = 'OK'
  end
end
unlease(done, owners)
finish(done, 'succeeded', now, nil, infos, extra)
history_hist(now, 'run', observe('run', runs))
spend_add(kind, paid_sum, now, by_backend)
return out
