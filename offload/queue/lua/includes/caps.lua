-- The daily caps: the counters of one cap window (the store's UTC day, `window_of` in clock.lua) are the jobs
-- submitted (each job once per window: the `counted` set) and the spend reserved (each submission's worst-case
-- cost, settled to the real cost when it is known).
--- @include "records"

local function cap_base(window) return P .. 'cap:' .. window .. ':' end

local function cap_open(window)
  local base = cap_base(window)
  return {base = base, jobs = tonumber(redis.call('GET', base .. 'jobs') or '0'),
          spend = tonumber(redis.call('GET', base .. 'spend') or '0'), new_jobs = 0, new_spend = 0}
end

-- Decide one submission against the caps, in order, as if reserved one by one. A job counted in the window
-- already passes the job cap; its spend is reserved again only for a new submission (`spend_again`).
-- Returns nil (reserved) or the cap that says no ('jobs' or 'spend'), and whether this reservation is the one
-- that counted the job in the window (a refund takes back only what its own reservation counted).
local function cap_take(st, id, estimate, job_cap, spend_cap, spend_again)
  local counted = redis.call('SISMEMBER', st.base .. 'counted', id) == 1
  if counted and not spend_again then return nil, false end
  if job_cap and not counted and st.jobs >= job_cap then return 'jobs', false end
  if spend_cap and st.spend + estimate > spend_cap then return 'spend', false end
  if not counted then
    redis.call('SADD', st.base .. 'counted', id)
    st.jobs = st.jobs + 1
    st.new_jobs = st.new_jobs + 1
  end
  st.spend = st.spend + estimate
  st.new_spend = st.new_spend + estimate
  return nil, not counted
end

local function cap_commit(st)
  if st.new_jobs > 0 then redis.call('INCRBY', st.base .. 'jobs', st.new_jobs) end
  if st.new_spend ~= 0 then redis.call('INCRBYFLOAT', st.base .. 'spend', st.new_spend) end
  if st.new_jobs > 0 or st.new_spend ~= 0 then
    for _, k in ipairs({'jobs', 'counted', 'spend'}) do redis.call('EXPIRE', st.base .. k, 259200) end
  end
end

-- Which cap a fresh submission with this estimated cost would exceed now, or nil.
local function cap_reached(window, job_cap, spend_cap, estimate)
  if window == '' or (not job_cap and not spend_cap) then return nil end
  local base = cap_base(window)
  if job_cap and tonumber(redis.call('GET', base .. 'jobs') or '0') >= job_cap then return 'jobs' end
  if spend_cap and tonumber(redis.call('GET', base .. 'spend') or '0') + estimate > spend_cap then
    return 'spend'
  end
  return nil
end

-- The real cost of a job's current submission replaces its reservation in the window it was reserved in.
-- `cost` nil: unknown, the reservation stands (it was the worst case). `refund`: nothing was started (the
-- provider refused the request, or the call was never sent), so the job is not counted either, unless an
-- earlier submission of it counted it in that window (`resv_c` '0': that run was paid for; records older than
-- the field count as counted here).
local function settle(k, id, cost, refund)
  local resv, resv_w, resv_c = unpack(redis.call('HMGET', k, 'resv', 'resv_w', 'resv_c'))
  if resv_w and resv_w ~= '' then
    local base = cap_base(resv_w)
    local delta = nil
    if refund then
      delta = -tonumber(resv or '0')
      if resv_c ~= '0' and redis.call('SREM', base .. 'counted', id) == 1 then
        redis.call('DECRBY', base .. 'jobs', 1)
      end
    elseif cost and resv then
      delta = cost - tonumber(resv)
    end
    if delta and delta ~= 0 then redis.call('INCRBYFLOAT', base .. 'spend', delta) end
    if refund then
      redis.call('HDEL', k, 'resv', 'resv_w', 'resv_n', 'resv_c')
    elseif delta then
      redis.call('HDEL', k, 'resv')
    end
  end
end

-- A submission begun and never sent (its worker drained, or the job cancelled, before the call): its intent closes
-- when it is still this lease's, and the reservation is refunded when it is that submission's (nothing ran: the
-- window keeps the place for another job, and a later send counts the job where it goes out).
local function close_unsent(k, id, token)
  local sub_open, intent_tok, sub_n, resv_n = unpack(redis.call('HMGET', k, 'sub_open', 'intent_tok', 'sub_n',
    'resv_n'))
  if sub_open == '1' and intent_tok == token then
    redis.call('HSET', k, 'sub_open', '0')
    if resv_n == sub_n then settle(k, id, nil, true) end
  end
end
