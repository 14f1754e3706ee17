-- The terminal states (succeeded, dead, cancelled) and the retention of finished records.
--- @include "records"
--- @include "outbox"
--- @include "events"
--- @include "metrics"
--- @include "history"
--- @include "attempts"
local CENTURY_S = 3153600000
local NONE = {}  -- nothing to unpack

-- The idempotency key of a job lives as long as the job is not finished (a job may wait for days: a
-- run_at far ahead, a long backlog), then as long as its record is kept, and at least a day.
local function idem_expire(idem, ret)
  if idem and idem ~= '' then
    redis.call('EXPIRE', P .. 'idem:' .. idem, math.max(ret, 86400))
  end
end

-- Enter a terminal state. The terminal set is scored by the time the record expires (finish + retention;
-- retention 0 keeps it for a century), and the reaper deletes expired records in bulk, which keeps an
-- EXPIRE per job off the hot path. `infos[i]` is a table with the job's `retention` and `idem` (its idempotency
-- key, and `callback`, its callback URL) when the caller read them already; `extra` an optional flat list of more
-- fields to set on every job. A job with a callback URL (its own or its queue's) gets its completion webhook in the
-- outbox in this same step, so no crash between the job ending and the POST can lose the notification.
local function finish(ids, state, now, err, infos, extra)
  if #ids == 0 then return end
  local zs, expiry = {}, {}  -- expiry: the terminal score by retention (a batch mostly shares one)
  local queue_cb = queue_callback()
  local notify, nn = {}, 0
  for i, id in ipairs(ids) do
    local k = jkey(id)
    local more = extra and extra[i] or NONE  -- the fields are passed as they are: no table built per job
    if err then  -- the token is kept: repeats are recognised
      redis.call('HSET', k, 'state', state, 'finished_at', now, 'owner', '', 'error', err, unpack(more))
    else
      redis.call('HSET', k, 'state', state, 'finished_at', now, 'owner', '', unpack(more))
    end
    local retention, idem, callback
    if infos and infos[i] then
      retention, idem, callback = infos[i].retention, infos[i].idem, infos[i].callback
    else
      retention, idem, callback = unpack(redis.call('HMGET', k, 'retention', 'idem', 'callback'))
    end
    if queue_cb or (callback and callback ~= '') then
      nn = nn + 1
      notify[nn] = id
    end
    local ret = tonumber(retention or '0') or 0
    if ret <= 0 then ret = CENTURY_S end
    idem_expire(idem, ret)
    local at = expiry[ret]
    if not at then
      at = fmt(now + ret * 1000)
      expiry[ret] = at
    end
    zs[2 * i - 1] = at
    zs[2 * i] = id
  end
  bulk_zadd(P .. state, zs)
  count(state, #ids)
  history_add(now, {state, #ids})
  event(ids, state)
  outbox_add(notify, now)
end

-- Delete the records of finished jobs whose retention ran out (terminal sets are scored by expiry time).
local function trim(now, limit)
  local trimmed = 0
  for _, set in ipairs({'succeeded', 'dead', 'cancelled'}) do
    local expired = redis.call('ZRANGEBYSCORE', P .. set, '-inf', now, 'LIMIT', 0, limit)
    if #expired > 0 then
      bulk('ZREM', P .. set, expired)
      outbox_forget(expired)
      local keys = attempt_keys(expired, {})  -- the attempts go with the job
      for _, id in ipairs(expired) do keys[#keys + 1] = jkey(id) end
      for j = 1, #keys, CHUNK do redis.call('DEL', unpack(keys, j, math.min(j + CHUNK - 1, #keys))) end
      trimmed = trimmed + #expired
    end
  end
  return trimmed
end

-- Jobs whose deadline passed before they could start (claim.lua) or be retried (fail.lua): dead, counted and
-- evented under a kind of their own, so dashboards tell them from jobs that failed at the provider.
local function deadline_passed(ids, now, errs)
  if #ids == 0 then return end
  if errs then
    for i, id in ipairs(ids) do finish({id}, 'dead', now, errs[i]) end
  else
    finish(ids, 'dead', now, 'deadline passed')
  end
  count('deadline_passed', #ids)
  event(ids, 'deadline_passed')
end
